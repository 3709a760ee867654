#!/usr/bin/env bash
# What a GPU host measures that the 2-core test VM cannot, in one call of under 10 minutes:
#   bash bench/lent_gpu_host.sh [--out DIR] [--quick]
#
#   1. tests/gpu check (g): a CUDA job whose caching allocator holds a large free cache at the
#      cut is evacuated; device memory reserved, released and checkpointed, the downtime, the
#      first steps after the resume, bitwise equal to an uninterrupted run.
#   2. bench/restore_width.py: 1, 2, 4 and 8 leaving ranks restored at once on a spare with a
#      core for each (the first size again at the end: a fresh VM's first restore is slow).
#   3. bench/stream_rate.py --pin: the image stream against raw TCP with each end on cores of
#      its own, as two agents on two hosts run it.
#
# Each step has its own deadline and the next one runs whatever the last one did; every report
# lands in DIR (default ./lent-out) with a log a step.  --quick shrinks every step so the script
# itself can be tried on a machine without a GPU (check (g) is then reported as skipped).
# Like tests/gpu/run.sh it brings its own CRIU and wheels (.gpu-bundle, `make gpu-bundle`).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$PWD/lent-out}"
QUICK=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "bench/lent_gpu_host.sh: unknown option $1 (expected --out DIR or --quick)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
source "$ROOT/tests/gpu/env.sh"
cd "$ROOT"
NCPU="$(nproc)"
echo "lent host: $NCPU cores, $(free -g | awk '/Mem:/ {print $2}') GiB, $($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [[ $QUICK == 1 ]]; then
  G=(--only g --budget-s 30 --steps 100 --g-cache-gib 0.5); G_S=120
  WIDTH=(--leaving 1,2 --state-mb 64); WIDTH_S=240
  STREAM=(--mib 64 --repeats 1); STREAM_S=60
else
  G=(--only g --budget-s 200 --host-gib 100); G_S=240
  WIDTH=(--leaving 1,2,4,8,1 --state-mb 256); WIDTH_S=230
  STREAM=(--mib 768 --repeats 5); STREAM_S=90
fi
# Two agents a host apart: the sender on the first core, the receiver on the last (a pair of
# cores each where there are 8 or more).
if (( NCPU >= 8 )); then PIN="0-1:$((NCPU - 2))-$((NCPU - 1))"; else PIN="0:$((NCPU - 1))"; fi

step() {  # step NAME SECONDS COMMAND...: run with a deadline, log to $OUT/NAME.log, say how it ended
  local name="$1" secs="$2"; shift 2
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local how="passed"; (( rc == 124 || rc == 137 )) && how="ran past its ${secs} s"; (( rc != 0 && rc != 124 && rc != 137 )) && how="failed (exit $rc)"
  printf '%-14s %-22s %4d s   %s\n' "$name" "$how" $((SECONDS - t0)) "$OUT/$name.log"
  tail -n 12 "$OUT/$name.log" | sed 's/^/    /'
  return 0
}
step gpu-check-g "$G_S" $PY tests/gpu/gpu_check.py --report "$OUT/gpu-report.json" "${G[@]}"
step restore-width "$WIDTH_S" $PY bench/restore_width.py "${WIDTH[@]}" --out "$OUT/restore-width.json"
step stream-rate "$STREAM_S" $PY bench/stream_rate.py "${STREAM[@]}" --pin "$PIN" --out "$OUT/stream-rate.json"
