#!/usr/bin/env bash
# podman with runc for the tests and the bench whose subject is ranks in containers
# (pitstop.dev.containers gives each local host a podman of its own; scripts/build-test-image.sh
# builds the image from this host's files).  Debian's crun is built without CRIU and cannot
# checkpoint: runc is what the tests run containers with.
#
# Idempotent: nothing is done where podman, runc and conmon are there.  Needs root and Debian's
# package archive.  No service is started (a policy-rc.d for the time of the install, removed after).
set -euo pipefail

log() { echo "provision-podman: $*" >&2; }

have() {
  command -v podman >/dev/null && command -v runc >/dev/null || return 1
  command -v conmon >/dev/null || [ -x /usr/libexec/podman/conmon ] || [ -x /usr/bin/conmon ]
}

if have; then
  exit 0
fi
[ "$(id -u)" = 0 ] || { log "podman is not installed and only root can install it (apt-get install podman runc)"; exit 1; }
command -v apt-get >/dev/null || { log "no apt-get here: install podman, runc and conmon by hand"; exit 1; }

policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ -n "$made_policy" ] && rm -f "$policy"' EXIT

log "installing Debian's podman and runc"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends podman runc conmon fuse-overlayfs uidmap >/dev/null
have || { log "podman, runc or conmon still missing after the install"; exit 1; }
log "installed podman $(dpkg-query -W -f='${Version}' podman), runc $(dpkg-query -W -f='${Version}' runc)"
