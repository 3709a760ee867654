#!/usr/bin/env bash
# Provision CRIU >= 4.2 for this host, without touching the host's libc or apt sources.
#
# Why: Debian bookworm's criu 3.17 fails `criu check` on Linux >= 6.16 ([vvar_vclock]),
# and trixie's 4.1 cannot dump TCP sockets there (SO_PASSCRED).  4.2.x from Debian forky
# works, but needs forky's libc, so it is unpacked into a private prefix and run through
# that prefix's own dynamic loader (see docs/architecture.md, "CRIU runtime").
#
# Usage: provision-criu.sh [PREFIX]      (default: $PITSTOP_CRIU_PREFIX or ~/.cache/pitstop/criu-4.2)
# Idempotent: an existing, working prefix is reused.  Prints the wrapper path on stdout.
set -euo pipefail

PREFIX=${1:-${PITSTOP_CRIU_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/pitstop/criu-4.2}}
SUITE=${PITSTOP_CRIU_SUITE:-forky}
MIRROR=${PITSTOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
WRAPPER="$PREFIX/bin/criu"

log() { echo "provision-criu: $*" >&2; }

# 1. A host criu that is new enough and passes its own check wins.
if [ -z "${PITSTOP_FORCE_PRIVATE_CRIU:-}" ] && command -v criu >/dev/null 2>&1; then
  v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p')
  if [ -n "$v" ] && printf '4.2\n%s\n' "$v" | sort -V -C && criu check >/dev/null 2>&1; then
    log "using host criu $v"; command -v criu; exit 0
  fi
fi

# 2. A private prefix that already works is reused.
if [ -x "$WRAPPER" ] && "$WRAPPER" --version >/dev/null 2>&1 && [ -d "$PREFIX/pycriu/pycriu" ] && [ -x "$PREFIX/bin/nft" ]; then
  log "reusing $PREFIX"; echo "$WRAPPER"; exit 0
fi

log "provisioning criu from Debian $SUITE into $PREFIX"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $SUITE main" >"$work/sources.list"
APT=(-o Dir::Etc::sourcelist="$work/sources.list" -o Dir::Etc::sourceparts=/nonexistent
     -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache" -o Dir::State::status=/dev/null
     -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o Acquire::Languages=none
     -o Debug::NoLocking=1)
apt-get "${APT[@]}" -qq update

# criu's whole dependency closure in that suite, plus the pure-Python bindings.
mapfile -t pkgs < <(apt-cache "${APT[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances criu nftables \
  | grep -v '^ ' | grep -v '^<' | sort -u)
pkgs+=(python3-pycriu)
log "downloading ${#pkgs[@]} packages"
(cd "$work/debs" && apt-get "${APT[@]}" -qq download "${pkgs[@]}")

rm -rf "$PREFIX.tmp" && mkdir -p "$PREFIX.tmp"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$PREFIX.tmp/root"; done

loader=""
for cand in "$PREFIX.tmp"/root/usr/lib64/ld-linux-x86-64.so.2 "$PREFIX.tmp"/root/lib64/ld-linux-x86-64.so.2; do
  if [ -e "$cand" ]; then loader=$cand; break; fi
done
[ -n "$loader" ] || { log "no dynamic loader in the downloaded libc6"; exit 1; }
mkdir -p "$PREFIX.tmp/bin" "$PREFIX.tmp/pycriu"
cp -r "$PREFIX.tmp"/root/usr/lib/python3/dist-packages/pycriu "$PREFIX.tmp/pycriu/"
rel_loader=${loader#"$PREFIX.tmp/"}
cat >"$PREFIX.tmp/bin/criu" <<WRAP
#!/bin/sh
# Runs Debian $SUITE's criu through its own loader and libraries (provision-criu.sh).
R="$PREFIX/root"
exec "$PREFIX/$rel_loader" --library-path "\$R/usr/lib/x86_64-linux-gnu:\$R/lib/x86_64-linux-gnu" "\$R/usr/sbin/criu" "\$@"
WRAP
# nft: used to lift CRIU's network lock when a capture is rolled back by resuming the source.
cat >"$PREFIX.tmp/bin/nft" <<WRAP
#!/bin/sh
R="$PREFIX/root"
exec "$PREFIX/$rel_loader" --library-path "\$R/usr/lib/x86_64-linux-gnu:\$R/lib/x86_64-linux-gnu" "\$R/usr/sbin/nft" "\$@"
WRAP
chmod 755 "$PREFIX.tmp/bin/criu" "$PREFIX.tmp/bin/nft"
rm -rf "$PREFIX" && mv "$PREFIX.tmp" "$PREFIX"
"$WRAPPER" --version >&2
echo "$WRAPPER"
