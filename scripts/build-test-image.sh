#!/usr/bin/env bash
# Build the container image pitstop's tests and benchmarks run ranks in, from this host's own files.
#
# Why from the host: no image registry can be reached where pitstop is built and tested, and the
# ranks must run the very interpreter the project's venv was made with (the venv is bind-mounted
# into the container at its own path, read-only, as an operator mounts pitstop's install).  The
# image holds that interpreter (its prefix, without site-packages and the test suite), every shared
# library the interpreter and the venv's native extensions load, /bin/sh and a few coreutils.
#
# Usage: build-test-image.sh [VENV]     (default: the checkout's .venv)
# Prints the path of the image tarball (`podman import TARBALL NAME` loads it).  Cached in
# ${XDG_CACHE_HOME:-~/.cache}/pitstop/test-image/, keyed by this script, the interpreter, the
# venv's native extensions and the host libraries they resolve to; an existing tarball is reused.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
VENV=$(cd "${1:-$here/../.venv}" && pwd)
CACHE=${PITSTOP_TEST_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pitstop/test-image}
log() { echo "build-test-image: $*" >&2; }

py=$(readlink -f "$VENV/bin/python")
[ -x "$py" ] || { log "no interpreter at $VENV/bin/python"; exit 1; }
prefix=$("$py" -c 'import sys; print(sys.base_prefix)')
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
stdlib="$prefix/lib/python$ver"

# Every ELF object the image must be able to load: the interpreter, its lib-dynload, the venv's
# extensions (torch, numpy, ...), and the tools a job's shell scripts use.
tools=(/bin/sh /bin/sleep /bin/cat /bin/ls /bin/echo /bin/true /bin/mkdir /bin/rm /usr/bin/env /usr/bin/tee)
mapfile -t objects < <({ echo "$py"; printf '%s\n' "${tools[@]}"; find "$stdlib/lib-dynload" "$VENV/lib" -name '*.so*' -type f; } | sort -u)

# The host libraries they resolve to (ldd), outside the interpreter's prefix and the venv.
mapfile -t libs < <(for o in "${objects[@]}"; do ldd "$o" 2>/dev/null || true; done \
  | sed -n 's/.*=> \(\/[^ ]*\) (0x.*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p' \
  | grep -v -e "^$VENV/" -e "^$prefix/" | sort -u)

key=$( { cat "$0"; echo "$py $prefix $ver"; for f in "$py" "${tools[@]}" "${libs[@]}"; do stat -L -c '%n %s %Y' "$f"; done; \
         find "$VENV/lib" -name '*.so*' -type f -printf '%P %s\n' | sort; } | sha256sum | cut -c1-16)
tarball="$CACHE/pitstop-test-$key.tar"
if [ -s "$tarball" ]; then log "reusing $tarball"; echo "$tarball"; exit 0; fi

log "building $tarball (interpreter $py, ${#libs[@]} host libraries)"
mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root"/{proc,sys,dev,tmp,run,root,etc,var/tmp} "$root$prefix/bin" "$root$prefix/lib"
chmod 1777 "$root/tmp" "$root/var/tmp"

copy() {  # copy a file (and, for a symlink, what it points to) to the same path in the image
  local f=$1
  mkdir -p "$root$(dirname "$f")"
  cp -a "$f" "$root$f"
  if [ -L "$f" ]; then copy "$(readlink -f "$f")"; fi
}
# /bin, /lib, /lib64, /sbin as the host lays them out (merged /usr: links), before anything is copied
for d in bin lib lib64 sbin; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$root/$d"; mkdir -p "$root/$(readlink -f "/$d")"; fi
done
for f in "${tools[@]}" "${libs[@]}"; do copy "$f"; done
copy /lib64/ld-linux-x86-64.so.2  # the loader, by the path every binary names
cp -a "$py" "$root$py"
cp -a "$prefix"/lib/libpython"$ver"*.so* "$root$prefix/lib/" 2>/dev/null || true
(cd "$prefix/lib" && tar --exclude="python$ver/site-packages" --exclude="python$ver/test" \
   --exclude="python$ver/idlelib" --exclude="python$ver/tkinter" --exclude="python$ver/turtledemo" \
   --exclude="python$ver/ensurepip" --exclude="python$ver/lib2to3" -cf - "python$ver") | tar -C "$root$prefix/lib" -xf -
mkdir -p "$root$stdlib/site-packages"

printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
: >"$root/etc/hosts"; : >"$root/etc/resolv.conf"; echo pitstop-test >"$root/etc/hostname"

tar -C "$root" --numeric-owner -cf "$work/image.tar" .
mv "$work/image.tar" "$tarball"
# Older builds of another key are of no use any more.
find "$CACHE" -maxdepth 1 -name 'pitstop-test-*.tar' ! -name "pitstop-test-$key.tar" -delete
log "built $(du -h "$tarball" | cut -f1)"
echo "$tarball"
