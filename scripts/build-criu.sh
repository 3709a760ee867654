#!/usr/bin/env bash
# Build the CRIU that pitstop carries: CRIU 4.2.1's source release as Debian's archive serves it,
# with the patch series in criu/patches/ applied, installed into a private prefix that
# service/pitstop/criu/runtime.py prefers over any other CRIU.
#
# Why: stock CRIU dumps every page a forked child still shares copy-on-write with its parent once
# per process and restores each such page with a read and a compare of its own (criu/README.md).
# The fixes are CRIU changes, kept as patch files, each one an upstream-ready commit.
#
# What it does, without touching the host's apt state, libc or sources:
#  1. fetches criu_4.2.1.orig.tar.xz and its .dsc from Debian (`apt-get source --download-only`
#     through a private sources list); apt checks the .dsc against the signed Sources index, this
#     script checks the tarball against the .dsc's SHA-256 and against the one pinned below;
#  2. downloads the build dependencies the host lacks (protobuf-c, libnl-3, libnet, libcap, libbsd,
#     libnftables, protoc) from the host's own Debian suite and unpacks them into a private sysroot;
#  3. applies criu/patches/series, builds `criu` against that sysroot with the host's compiler
#     (a native build needs no newer libc), and installs the binary with the libraries it needs
#     (RPATH $ORIGIN/../lib: the prefix can be moved) into PREFIX.
#
# The build is keyed by the tarball, the patches and this script: an unchanged key reuses the
# prefix and the build tree (CRIU's own test suite runs from that tree: scripts/criu-zdtm.sh).
# Usage: build-criu.sh [PREFIX]  (default $PITSTOP_CRIU_CARRIED_PREFIX or ~/.cache/pitstop/criu-carried)
# Prints the criu path on stdout.  Exits non-zero when it cannot build: pitstop then runs the stock
# CRIU that provision-criu.sh provides, and `pitstop doctor` says so.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pitstop
PREFIX=${1:-${PITSTOP_CRIU_CARRIED_PREFIX:-$CACHE/criu-carried}}
WORK=${PITSTOP_CRIU_BUILD_DIR:-$CACHE/criu-build}
MIRROR=${PITSTOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SRC_SUITE=${PITSTOP_CRIU_SOURCE_SUITE:-forky}
VERSION=4.2.1
ORIG=criu_${VERSION}.orig.tar.xz
ORIG_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
PATCHES="$ROOT/criu/patches"
# Another series file (patch names in criu/patches/), for a build with part of the series: the
# benchmark of each patch's effect (bench/criu_patches.py) builds into prefixes of its own.
SERIES=${PITSTOP_CRIU_SERIES:-$PATCHES/series}
# The host's suite for the build dependencies (their libraries must run with the host's libc).
HOST_SUITE=${PITSTOP_CRIU_BUILD_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}
BUILD_DEPS=(libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libprotobuf-dev libnl-3-dev libnet1-dev
            libcap-dev libbsd-dev libnftables-dev uuid-dev nftables)

log() { echo "build-criu: $*" >&2; }
die() { log "$*"; exit 1; }

key() {  # what the build depends on: the source, the patches in series order, this script
  {
    echo "$ORIG_SHA256"
    sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1
    while read -r p; do
      [[ -z "$p" || "$p" == \#* ]] && continue
      echo "$p"; sha256sum "$PATCHES/$p" | cut -d' ' -f1
    done <"$SERIES"
  } | sha256sum | cut -c1-16
}

KEY=$(key)
# Reused only with its build tree: CRIU's own tests (scripts/criu-zdtm.sh) run from it, and a build of
# another series (a benchmark's, into another PREFIX) replaces the tree of this one.
if [[ -x "$PREFIX/bin/criu" && "$(cat "$PREFIX/BUILD-KEY" 2>/dev/null)" == "$KEY" ]] \
   && "$PREFIX/bin/criu" --version >/dev/null 2>&1 && [[ -d "$PREFIX/pycriu/pycriu" ]] \
   && [[ -f "$(cat "$PREFIX/BUILD-TREE" 2>/dev/null)/test/zdtm.py" ]]; then
  log "reusing $PREFIX (build $KEY)"; echo "$PREFIX/bin/criu"; exit 0
fi
command -v gcc >/dev/null && command -v make >/dev/null || die "need gcc and make to build CRIU"

mkdir -p "$WORK"
exec 9>"$WORK/.lock"
flock 9  # two `make`s at once build once

apt_private() {  # apt-get/apt-cache with a private list of one suite; never the host's state
  local dir=$1; shift
  local a=(-o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts=/nonexistent
           -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" -o Dir::State::status=/var/lib/dpkg/status
           -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o Acquire::Languages=none
           -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  "$@" "${a[@]}"
}
apt_dir() {  # a private apt directory for "deb[-src] MIRROR SUITE main"
  local dir=$1 kind=$2 suite=$3
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  echo "$kind [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $suite main" >"$dir/sources.list"
  apt_private "$dir" apt-get -qq update
}

# 1. The source release, checked.
src="$WORK/source"
if [[ ! -f "$src/$ORIG" ]] || ! echo "$ORIG_SHA256  $src/$ORIG" | sha256sum -c --quiet - 2>/dev/null; then
  log "fetching CRIU $VERSION's source from Debian $SRC_SUITE"
  rm -rf "$src" && mkdir -p "$src"
  apt_dir "$WORK/apt-src" deb-src "$SRC_SUITE"
  # The Debian packaging tarball may be missing from the archive; the .dsc and the orig are enough.
  (cd "$src" && apt_private "$WORK/apt-src" apt-get -qq source --download-only criu >/dev/null 2>&1 || true)
fi
dsc=$(ls "$src"/criu_"$VERSION"-*.dsc 2>/dev/null | head -1)
[[ -f "$src/$ORIG" && -n "$dsc" ]] || die "could not download $ORIG and its .dsc from Debian $SRC_SUITE"
want=$(awk '/^Checksums-Sha256:/{f=1;next} f&&/^ /{if($3=="'"$ORIG"'")print $1} /^[^ ]/&&!/^Checksums-Sha256:/{f=0}' \
       "$dsc")
got=$(sha256sum "$src/$ORIG" | cut -d' ' -f1)
[[ "$want" == "$got" ]] || die "$ORIG does not match its .dsc (sha256 $got, .dsc says ${want:-nothing})"
[[ "$got" == "$ORIG_SHA256" ]] || die "$ORIG is not the release pitstop's patches are for (sha256 $got)"

# 2. The build dependencies, unpacked into a private sysroot.
sysroot="$WORK/sysroot-$HOST_SUITE"
if [[ ! -f "$sysroot/.complete" ]]; then
  log "downloading build dependencies from Debian $HOST_SUITE"
  apt_dir "$WORK/apt-$HOST_SUITE" deb "$HOST_SUITE"
  # What the host lacks of the dependencies' closure (`-s`: nothing is installed).
  mapfile -t pkgs < <(apt_private "$WORK/apt-$HOST_SUITE" apt-get -s -qq install --no-install-recommends \
                      "${BUILD_DEPS[@]}" 2>/dev/null | awk '/^Inst /{print $2}')
  rm -rf "$sysroot" "$WORK/debs" && mkdir -p "$sysroot" "$WORK/debs"
  if ((${#pkgs[@]})); then
    (cd "$WORK/debs" && apt_private "$WORK/apt-$HOST_SUITE" apt-get -qq download "${pkgs[@]}")
    for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
  fi
  # Absolute links and linker scripts name host paths: point them into the sysroot where it has them.
  while IFS= read -r l; do
    t=$(readlink "$l"); [[ "$t" == /* && -e "$sysroot$t" ]] && ln -sfn "$sysroot$t" "$l"
  done < <(find "$sysroot" -type l)
  for s in "$sysroot"/usr/lib/x86_64-linux-gnu/*.so; do
    [[ -f "$s" && ! -L "$s" ]] && grep -q "GNU ld script" "$s" 2>/dev/null || continue
    for p in $(grep -o '/[^ ()]*\.so[.0-9]*' "$s"); do
      [[ -e "$sysroot$p" ]] && sed -i "s#$p#$sysroot$p#" "$s"
    done
  done
  touch "$sysroot/.complete"
fi

# 3. Patch and build.
tree="$WORK/criu-$VERSION-$KEY"
if [[ ! -x "$tree/criu/criu" ]]; then
  log "building CRIU $VERSION with $(grep -cv '^\s*\(#\|$\)' "$SERIES") patches (build $KEY)"
  rm -rf "$WORK"/criu-"$VERSION"-* "$tree.tmp" && mkdir -p "$tree.tmp"
  tar -C "$tree.tmp" --strip-components=1 -xf "$src/$ORIG"
  while read -r p; do
    [[ -z "$p" || "$p" == \#* ]] && continue
    patch -d "$tree.tmp" -p1 --batch --quiet --no-backup-if-mismatch <"$PATCHES/$p" || die "patch $p does not apply"
  done <"$SERIES"
  mkdir -p "$tree.tmp/.pitstop-bin"
  # CRIU's images/Makefile gives protoc --proto_path=/usr/include; the sysroot's must come first.
  printf '#!/bin/sh\nexec "%s/usr/bin/protoc" -I"%s/usr/include" "$@"\n' "$sysroot" "$sysroot" >"$tree.tmp/.pitstop-bin/protoc"
  chmod 755 "$tree.tmp/.pitstop-bin/protoc"
  mv "$tree.tmp" "$tree"
  libs="$sysroot/usr/lib/x86_64-linux-gnu:$sysroot/lib/x86_64-linux-gnu"
  if ! (cd "$tree" && env PKG_CONFIG_SYSROOT_DIR="$sysroot" PKG_CONFIG_LIBDIR="$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig" \
          C_INCLUDE_PATH="$sysroot/usr/include" LIBRARY_PATH="$libs" LD_LIBRARY_PATH="$libs" \
          PATH="$tree/.pitstop-bin:$sysroot/usr/bin:$PATH" LD_RUN_PATH='$ORIGIN/../lib' \
          nice make -j"$(nproc)" NO_GNUTLS=1 USERCFLAGS="-Wl,--disable-new-dtags" criu >"$WORK/build.log" 2>&1); then
    tail -20 "$WORK/build.log" >&2
    rm -rf "$tree"
    die "CRIU did not build (log: $WORK/build.log)"
  fi
fi

# 4. Install: binary, the sysroot's runtime libraries, nft, pycriu (Debian's python3-pycriu of the
#    same release: rpc.proto is untouched by the patches).
rm -rf "$PREFIX.tmp" && mkdir -p "$PREFIX.tmp/bin" "$PREFIX.tmp/lib" "$PREFIX.tmp/pycriu"
cp "$tree/criu/criu" "$PREFIX.tmp/bin/criu"
cp -a "$sysroot"/usr/lib/x86_64-linux-gnu/*.so.* "$sysroot"/lib/x86_64-linux-gnu/*.so.* "$PREFIX.tmp/lib/" 2>/dev/null || true
if [[ -x "$sysroot/usr/sbin/nft" ]]; then
  cp "$sysroot/usr/sbin/nft" "$PREFIX.tmp/lib/nft"
  printf '#!/bin/sh\nD=$(dirname "$(readlink -f "$0")")/..\nLD_LIBRARY_PATH="$D/lib" exec "$D/lib/nft" "$@"\n' >"$PREFIX.tmp/bin/nft"
  chmod 755 "$PREFIX.tmp/bin/nft"
elif command -v nft >/dev/null; then
  ln -s "$(command -v nft)" "$PREFIX.tmp/bin/nft"
fi
stock=${PITSTOP_CRIU_PREFIX:-$CACHE/criu-4.2}
if [[ -d "$stock/pycriu/pycriu" ]]; then
  cp -r "$stock/pycriu/pycriu" "$PREFIX.tmp/pycriu/"
else
  log "fetching python3-pycriu $VERSION from Debian $SRC_SUITE"
  apt_dir "$WORK/apt-bin" deb "$SRC_SUITE"
  rm -rf "$WORK/pycriu" && mkdir -p "$WORK/pycriu"
  (cd "$WORK/pycriu" && apt_private "$WORK/apt-bin" apt-get -qq download python3-pycriu) \
    || die "could not download python3-pycriu"
  dpkg-deb -x "$WORK"/pycriu/python3-pycriu_*.deb "$WORK/pycriu/root"
  cp -r "$WORK/pycriu/root/usr/lib/python3/dist-packages/pycriu" "$PREFIX.tmp/pycriu/"
fi
cp "$SERIES" "$PREFIX.tmp/PATCHES"
echo "$tree" >"$PREFIX.tmp/BUILD-TREE"
echo "$KEY" >"$PREFIX.tmp/BUILD-KEY"
"$PREFIX.tmp/bin/criu" --version >/dev/null || die "the built criu does not run"
rm -rf "$PREFIX" && mv "$PREFIX.tmp" "$PREFIX"
log "installed $PREFIX (build $KEY)"
echo "$PREFIX/bin/criu"
