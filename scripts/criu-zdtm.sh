#!/usr/bin/env bash
# Run the CRIU tests named in criu/zdtm.list (CRIU's own zdtm suite) against the CRIU pitstop carries.
#
# Why: the patches in criu/patches/ change how CRIU dumps and restores memory; CRIU's own tests of
# copy-on-write, forks and mappings (and the ones the patches add) must pass against the build
# pitstop runs, as they would in CRIU's CI.  The tests are built and run from the build tree that
# scripts/build-criu.sh keeps beside the installed prefix, in zdtm's host flavour ("h"), as root;
# the tests marked "lazy" run a second time with a lazy restore.
#
# Usage: criu-zdtm.sh [TEST...]   (default: every test in criu/zdtm.list)
# Needs: the carried build (scripts/build-criu.sh), the project's .venv (zdtm.py imports yaml and
# pycriu's protobuf).  Exits non-zero if a test fails; the report is in $OUT (default
# bench/out/criu-zdtm), with each failed test's CRIU logs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pitstop
PREFIX=${PITSTOP_CRIU_CARRIED_PREFIX:-$CACHE/criu-carried}
OUT=${OUT:-$ROOT/bench/out/criu-zdtm}
PY=${PY:-$ROOT/.venv/bin/python}

log() { echo "criu-zdtm: $*" >&2; }
[[ $(id -u) == 0 ]] || { log "zdtm needs root"; exit 1; }
[[ -x "$PREFIX/bin/criu" && -f "$PREFIX/BUILD-TREE" ]] || { log "no carried CRIU in $PREFIX: run scripts/build-criu.sh"; exit 1; }
tree=$(cat "$PREFIX/BUILD-TREE")
[[ -f "$tree/test/zdtm.py" ]] || { log "the build tree $tree is gone: run scripts/build-criu.sh"; exit 1; }

plain=(); lazy=()
if (($#)); then
  plain=("$@")
else
  while read -r name mode; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    plain+=("$name"); [[ "${mode:-}" == lazy ]] && lazy+=("$name")
  done <"$ROOT/criu/zdtm.list"
fi

# zdtm.py re-runs itself through `#!/usr/bin/env python3`: that must be the interpreter with its imports.
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" >"$shim/python3"
chmod 755 "$shim/python3"

# zdtm runs a test not flagged "suid" as uid 18943, and CRIU then reads its rlimits with prlimit(),
# which needs CAP_SYS_RESOURCE for another user's process: root in this VM kind lacks it, so every
# such test fails at "Can't get rlimit" with any CRIU.  The listed tests run as root instead.
"$PY" - "$tree/test/zdtm/static" "${plain[@]}" <<'PY'
import ast, os, sys
d = sys.argv[1]
for t in sys.argv[2:]:
    p = os.path.join(d, t + ".desc")
    text = "".join(ln for ln in open(p) if not ln.lstrip().startswith("#")) if os.path.exists(p) else ""
    desc = ast.literal_eval(text) if text.strip() else {}
    flags = desc.get("flags", "").split()
    if "suid" not in flags:
        desc["flags"] = " ".join(flags + ["suid"])
        if os.path.islink(p):
            os.unlink(p)
        open(p, "w").write(repr(desc) + "\n")
PY

log "building $((${#plain[@]})) tests in $tree/test/zdtm"
nice make -s -C "$tree/test/zdtm/lib" >/dev/null
nice make -s -C "$tree/test/zdtm/static" "${plain[@]}" >/dev/null

rm -rf "$OUT" && mkdir -p "$OUT"
run() {  # run NAME ARGS... : one zdtm.py run over the tests, its output in $OUT/NAME.log
  local name=$1; shift
  local args=(run -f h --keep-going --ignore-taint --criu-bin "$PREFIX/bin/criu" --pycriu-search-path "$PREFIX/pycriu"
              --report "$OUT/$name-report" "$@")
  (cd "$tree/test" && PATH="$shim:$PATH" "$PY" zdtm.py "${args[@]}") >"$OUT/$name.log" 2>&1
}
tests=(); for t in "${plain[@]}"; do tests+=(-t "zdtm/static/$t"); done
start=$SECONDS
rc=0
run eager "${tests[@]}" || rc=1
if ((${#lazy[@]})); then
  tests=(); for t in "${lazy[@]}"; do tests+=(-t "zdtm/static/$t"); done
  run lazy --lazy-pages "${tests[@]}" || rc=1
fi
pass=$(cat "$OUT"/*.log | grep -c "^=* Test zdtm/static/.* PASS =*$" || true)
skip=$(cat "$OUT"/*.log | grep -c "^Skipping" || true)
fail=$(cat "$OUT"/*.log | grep -E "^#+ Test zdtm/static/.* FAIL" | sed -E 's/.*Test (zdtm\/static\/[^ ]+) FAIL.*/\1/' | sort -u || true)
echo "criu-zdtm: $pass passed, $skip skipped, $(echo -n "$fail" | grep -c . || true) failed in $((SECONDS - start)) s" \
     "(CRIU $("$PREFIX/bin/criu" --version | sed -n 's/^Version: //p'), patches: $(grep -cv '^\s*\(#\|$\)' "$PREFIX/PATCHES"); logs in $OUT)"
[[ -n "$fail" ]] && { echo "failed:"; echo "$fail"; rc=1; }
exit $rc
