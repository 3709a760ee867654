#!/usr/bin/env bash
# Chromium for the dashboard's browser test (tests/test_dashboard_e2e.py), headless.
# Debian's package; nothing is done where a chromium is already on the path.  Needs root and
# Debian's package archive (as scripts/provision-slurm.sh).
set -euo pipefail
log() { echo "provision-chromium: $*" >&2; }
for c in chromium chromium-browser; do
  if command -v "$c" >/dev/null; then command -v "$c"; exit 0; fi
done
[ "$(id -u)" = 0 ] || { log "Chromium is not installed and only root can install it (apt-get install chromium)"; exit 1; }
command -v apt-get >/dev/null || { log "no apt-get here: install Chromium by hand"; exit 1; }
log "installing Debian's chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium
