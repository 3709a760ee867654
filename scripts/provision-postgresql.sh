#!/usr/bin/env bash
# PostgreSQL for the tests and the bench whose subject it is (pitstop.dev.devpostgres starts a
# private server with it: initdb into a temporary directory, as an unprivileged user, on a free port).
#
# Debian's postgresql package (15 on bookworm): the server runs only when a test starts it, with a
# data directory of its own; the package's own service is never started (a policy-rc.d for the time
# of the install, removed after).  Idempotent: nothing is done where initdb and postgres are already
# there (in PATH or under /usr/lib/postgresql/*/bin).  Needs root and Debian's package archive.
set -euo pipefail

log() { echo "provision-postgresql: $*" >&2; }

have() {
  command -v initdb >/dev/null && command -v postgres >/dev/null && return 0
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && return 0
  done
  return 1
}

if have; then
  exit 0
fi
[ "$(id -u)" = 0 ] || { log "PostgreSQL is not installed and only root can install it (apt-get install postgresql)"; exit 1; }
command -v apt-get >/dev/null || { log "no apt-get here: install PostgreSQL's server (initdb, postgres) by hand"; exit 1; }

policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ -n "$made_policy" ] && rm -f "$policy"' EXIT

log "installing Debian's postgresql"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends postgresql >/dev/null
have
log "installed postgresql $(dpkg-query -W -f='${Version}' postgresql)"
