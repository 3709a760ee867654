#!/usr/bin/env bash
# One-shot GPU validation (see tests/gpu/gpu_check.py): at most 8 minutes on one GPU host.
#   bash tests/gpu/run.sh [--out DIR] [gpu_check.py options...]
# Brings its own CRIU and wheels (made by `make gpu-bundle` into .gpu-bundle/): nothing
# is fetched from a registry.  Uses the host's python3 that has torch with CUDA.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
if [[ "${1:-}" == "--out" ]]; then OUT="$2"; shift 2; fi
mkdir -p "$OUT"
source "$ROOT/tests/gpu/env.sh"
echo "pitstop GPU check: $($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# Not exec: the EXIT trap must still remove the scratch directory (an exec'd run left one
# behind every time).
rc=0
timeout --kill-after=10 480 $PY "$ROOT/tests/gpu/gpu_check.py" --report "$OUT/gpu-report.json" "$@" || rc=$?
exit $rc
