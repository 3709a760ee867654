# Sourced, not run: the environment tests/gpu/run.sh and bench/lent_gpu_host.sh work in on a GPU
# host that cannot reach a package registry.  Needs ROOT (the repository); sets PY (the host's
# python3, or $PYTHON), PYTHONPATH (the service, then the bundle's wheels for this interpreter),
# PITSTOP_CRIU_PREFIX (the bundle's CRIU >= 4.2) and SCRATCH, with an EXIT trap that removes it;
# builds the shim and native/ when a compiler exists, else the carried builds are used.
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
