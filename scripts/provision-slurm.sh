#!/usr/bin/env bash
# Slurm for the tests whose subject it is (tests/slurm_cluster.py starts a private cluster with it).
#
# Debian's slurmctld, slurmd and client (22.05 on bookworm): the daemons run only when a test
# starts them, with a configuration of its own; the packages' own services are never started
# (a policy-rc.d for the time of the install, removed after).  Idempotent: nothing is done where
# all three programs are already there.  Needs root and Debian's package archive.
set -euo pipefail

log() { echo "provision-slurm: $*" >&2; }

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null; then
  exit 0
fi
[ "$(id -u)" = 0 ] || { log "Slurm is not installed and only root can install it (apt-get install slurmctld slurmd slurm-client)"; exit 1; }
command -v apt-get >/dev/null || { log "no apt-get here: install slurmctld, slurmd and the Slurm client by hand"; exit 1; }

policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ -n "$made_policy" ] && rm -f "$policy"' EXIT

log "installing Debian's slurmctld, slurmd and slurm-client"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null
command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null
log "installed slurm $(dpkg-query -W -f='${Version}' slurmctld)"
