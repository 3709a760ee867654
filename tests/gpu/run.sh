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
PY="${PYTHON:-python3}"
BUNDLE="$ROOT/.gpu-bundle"
SCRATCH="$(mktemp -d /tmp/pitstop-gpu-run.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
PYV="$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
export PYTHONPATH="$ROOT/service${PYTHONPATH:+:$PYTHONPATH}"

if [[ -d "$BUNDLE" ]]; then
  # Wheels for this interpreter, unpacked (a wheel is a zip) into a private site dir.
  SITE="$SCRATCH/site"
  mkdir -p "$SITE"
  for w in "$BUNDLE"/wheels/*.whl; do
    case "$(basename "$w")" in
      *-cp3*-cp3*) [[ "$(basename "$w")" == *"-cp$PYV-"* ]] || continue ;;
    esac
    # Keep what the host already has (cuda-bindings shipped with its torch, say): a wheel is
    # unpacked only when none of its top-level modules imports here.
    $PY - "$w" <<'HAS' && continue
import importlib.util, sys, zipfile
names = {n.split("/")[0].removesuffix(".py") for n in zipfile.ZipFile(sys.argv[1]).namelist()
         if not n.split("/")[0].endswith((".dist-info", ".data")) and not n.startswith("_")}
names.discard("")
sys.exit(0 if names and all(importlib.util.find_spec(n) for n in names) else 1)
HAS
    $PY -m zipfile -e "$w" "$SITE" >/dev/null
  done
  export PYTHONPATH="$PYTHONPATH:$SITE"
  # CRIU >= 4.2 with its own loader and libraries (scripts/provision-criu.sh's layout).
  if [[ -f "$BUNDLE/criu.tar.xz" ]]; then
    tar -C "$SCRATCH" -xJf "$BUNDLE/criu.tar.xz"
    P="$SCRATCH/criu-4.2"
    mkdir -p "$P/bin"
    for tool in criu nft; do
      sbin=usr/sbin/$tool
      cat > "$P/bin/$tool" <<WRAP
#!/bin/sh
R="$P/root"
exec "\$R/usr/lib64/ld-linux-x86-64.so.2" --library-path "\$R/usr/lib/x86_64-linux-gnu:\$R/lib/x86_64-linux-gnu" "\$R/$sbin" "\$@"
WRAP
      chmod +x "$P/bin/$tool"
    done
    export PITSTOP_CRIU_PREFIX="$P"
  fi
fi
# The shim: build it here when a compiler exists, else use the one carried along.
if command -v cc >/dev/null && [[ -f "$ROOT/shim/Makefile" ]]; then
  make -s -C "$ROOT/shim" >/dev/null 2>&1 || echo "note: building the shim failed; using a carried build if any"
  make -s -C "$ROOT/native" >/dev/null 2>&1 || echo "note: building native/ failed; using a carried build if any"
fi
echo "pitstop GPU check: $($PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# Not exec: the EXIT trap must still remove the scratch directory (an exec'd run left one
# behind every time).
rc=0
timeout --kill-after=10 480 $PY "$ROOT/tests/gpu/gpu_check.py" --report "$OUT/gpu-report.json" "$@" || rc=$?
exit $rc
