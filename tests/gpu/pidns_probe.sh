#!/usr/bin/env bash
# Which launch lets CUDA initialise, and which /proc paths it uses in each: a plain
# child, a pid namespace sharing the parent's /proc (how `pitstop run` starts workers),
# and a pid namespace with its own /proc.  Diagnostic for tests/gpu; prints a report.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
T=/tmp/proctrace.$$.so
trap 'rm -f "$T"' EXIT
cc -shared -fPIC -O1 -o "$T" "$HERE/proctrace.c" -ldl || { echo "cannot build proctrace"; exit 2; }
PROG='import torch; torch.cuda.init(); print("CUDA-OK devices", torch.cuda.device_count())'
for launch in "" "unshare --pid --fork" "unshare --pid --fork --mount-proc"; do
  echo "=== launch: ${launch:-plain}"
  LD_PRELOAD="$T" timeout 120 $launch "$PY" -c "$PROG" >/tmp/probe.out 2>&1
  echo "exit $?"
  grep -E "CUDA-OK|Error|error" /tmp/probe.out | grep -v proctrace | head -5
  echo "--- /proc and /dev/nvidia paths (failures first; pids replaced by N)"
  grep '^proctrace:' /tmp/probe.out | grep -- '= -1' | sort | uniq -c | sort -rn | head -40
  grep '^proctrace:' /tmp/probe.out | grep -v -- '= -1' | sed -E 's#/proc/[0-9]+#/proc/N#g; s#task/[0-9]+#task/N#g; s#= [0-9]+$#= fd#' \
    | sort | uniq -c | sort -rn | head -40
done
