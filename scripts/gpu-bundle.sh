#!/usr/bin/env bash
# Pack what tests/gpu/run.sh needs on a GPU host that cannot reach a package registry:
# CRIU (private prefix, from provision-criu.sh), and wheels for CPython 3.10-3.13 (or PITSTOP_GPU_PYTHONS).
# Output: .gpu-bundle/ (ignored by git; carried to the GPU machine).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
B="$ROOT/.gpu-bundle"
PIP="${PIP:-$ROOT/.venv/bin/python -m pip}"
PREFIX="${PITSTOP_CRIU_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/pitstop/criu-4.2}"
# PITSTOP_GPU_PYTHONS: the interpreters to pack for (a GPU host's python3 is one of them);
# one version keeps the bundle under 40 MB.
PYVERS="${PITSTOP_GPU_PYTHONS:-3.10 3.11 3.12 3.13}"
rm -rf "$B" && mkdir -p "$B/wheels"
for v in $PYVERS; do
  $PIP download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux_2_28_x86_64 \
    -d "$B/wheels" "cuda-bindings>=12.8,<14" 2>&1 | grep -v "is ignored" || true
done
$PIP download -q --no-deps --only-binary=:all: -d "$B/wheels" cuda-pathfinder structlog nvidia-ml-py \
  "protobuf>=4.25" 2>&1 | grep -v "is ignored" || true
# The service itself (check (e) runs a coordinator and agents there), with every dependency
# pyproject.toml names (extras included: uvicorn[standard] brings httptools, which the agent's
# server imports), resolved for each interpreter; run.sh unpacks only those the host cannot
# import already.  cuda-bindings was packed above, held below 14.
mapfile -t DEPS < <(python3 - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    if not d.replace("_", "-").startswith("cuda-bindings"):
        print(d.split("#")[0].strip())
PY
)
for v in $PYVERS; do
  $PIP download -q --only-binary=:all: --python-version "$v" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$B/wheels" "${DEPS[@]}" 2>&1 \
    | grep -v "is ignored" || true
done
[[ -x "$PREFIX/bin/criu" ]] || "$ROOT/scripts/provision-criu.sh" >/dev/null
tar -C "$(dirname "$PREFIX")" --exclude='criu-4.2/bin' -cJf "$B/criu.tar.xz" "$(basename "$PREFIX")"
du -sh "$B" "$B"/wheels/* "$B/criu.tar.xz"
