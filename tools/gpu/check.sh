#!/usr/bin/env bash
# The whole CUDA check in one call, for a session lent a GPU machine (docs/gpu.md):
#
#   bash tools/gpu/check.sh                 # what `make gpu-check` runs; <= 8 minutes on one H100
#   bash tools/gpu/check.sh --dry-run       # plumbing only (CPU, seconds): CUDA steps reported skipped
#   bash tools/gpu/check.sh --cpu-rehearsal # every step on the CPU (DS_GPU_TESTS_ON_CPU=1, bench --dry-run)
#   bash tools/gpu/check.sh --steps env,install,import,gpu-tests --out /tmp/x --wheels /path/to/.whl
#
# Steps, each under its own `timeout` (a hang costs that step, not the call):
#   env        python, torch, CUDA, device name (env.json)
#   install    wheels from .whl/ into a temporary target dir on PYTHONPATH, never the system
#              (tools/gpu/install_wheels.py; DeepSpeed 0.19.8 into a dir of its own)
#   import     this package imports with them; DeepSpeed 0.19.8 imports alone from its dir
#   gpu-tests  pytest -m gpu tests/gpu tests/unit             (needs CUDA)
#   unit-tests pytest tests/unit -m "not gpu": the in-process suite with CUDA visible (needs CUDA)
#   bench      benchmarks/bench_gpu.py: torch vs ours (ZeRO 0-3, offload) vs DeepSpeed (needs CUDA)
# Writes $OUT (else ./gpu-check-out): check.log, one log per step, results.json, summary.md;
# --bundle (what `make gpu-check` passes) then packs all but the last three into logs.tar.gz.
# Runs with the image's python (PYTHON, else the first python3/python that imports torch): the
# device copy of the tree has no .venv. Exit 0 when no step failed or timed out.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT_DIR="${OUT:-$REPO/gpu-check-out}"
WHEELS="$REPO/.whl"
DRY_RUN=0
REHEARSAL=0
BUNDLE=0
BENCH_ARGS=()
STEPS="env,install,import,gpu-tests,unit-tests,bench"
ALL_STEPS=" env install import gpu-tests unit-tests bench "
# Seconds per step: 20+45+40+100+60+200 = 465 at most (under 8 minutes), each killed 5 s after its limit.
declare -A LIMIT=([env]=20 [install]=45 [import]=40 [gpu-tests]=100 [unit-tests]=60 [bench]=200)

usage() { sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --cpu-rehearsal) REHEARSAL=1 ;;
    --bundle) BUNDLE=1 ;;
    --out) OUT_DIR="${2:?--out needs a directory}"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    --steps) STEPS="${2:?--steps needs a comma-separated list}"; shift ;;
    --limit) # --limit step=seconds
      kv="${2:?--limit needs step=seconds}"; shift
      [[ "$kv" =~ ^([a-z-]+)=([0-9]+)$ && "$ALL_STEPS" == *" ${BASH_REMATCH[1]} "* ]] || {
        echo "check.sh: --limit '$kv': expected step=seconds with step one of:$ALL_STEPS" >&2; exit 2; }
      LIMIT[${BASH_REMATCH[1]}]="${BASH_REMATCH[2]}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check.sh: unknown argument '$1' (allowed: --dry-run, --cpu-rehearsal, --bundle, --out DIR, --wheels DIR, --steps LIST, --limit step=S, --help)" >&2; exit 2 ;;
  esac
  shift
done
for s in ${STEPS//,/ }; do
  [[ "$ALL_STEPS" == *" $s "* ]] || { echo "check.sh: --steps: unknown step '$s' (allowed:$ALL_STEPS)" >&2; exit 2; }
done

if [ -z "${PYTHON:-}" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then PYTHON="$candidate"; break; fi
  done
fi
[ -n "${PYTHON:-}" ] || { echo "check.sh: no python with torch found; set PYTHON=/path/to/python" >&2; exit 2; }

mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WHEELS="$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")"
PKGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-pkgs.XXXXXX")"   # installed packages: never under $OUT
trap 'rm -rf "$PKGS"' EXIT
RESULTS="$OUT_DIR/steps.jsonl"
LOG="$OUT_DIR/check.log"
: > "$RESULTS"
: > "$LOG"
rm -f "$OUT_DIR"/{env,install,bench,results}.json "$OUT_DIR"/*-tests.xml "$OUT_DIR"/summary.md \
      "$OUT_DIR"/{env,install,import,gpu-tests,unit-tests,bench,bench-workers}.log   # no stale results
log() { echo "[gpu-check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
log "repo $REPO, python $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])')), out $OUT_DIR, wheels $WHEELS, dry_run $DRY_RUN"

export PYTHONPATH="$REPO:$PKGS/deps${PYTHONPATH:+:$PYTHONPATH}"
export DS_GPU_CHECK_DS_PATH="$PKGS/ds:$PKGS/deps"   # bench_gpu.py's DeepSpeed subprocess path
export PATH="$PKGS/deps/bin:$PATH"   # the ninja wheel's binary: torch's JIT builds look for it on PATH
export PYTHONDONTWRITEBYTECODE=1
HAVE_CUDA=0

record() {   # record step status rc seconds note
  "$PYTHON" - "$RESULTS" "$@" <<'EOF'
import json, sys
path, step, status, rc, seconds, limit, note = sys.argv[1:8]
with open(path, "a") as f:
    f.write(json.dumps({"step": step, "status": status, "rc": int(rc), "seconds": float(seconds),
                        "limit_s": int(limit), "log": f"{step}.log", "note": note}) + "\n")
EOF
}

run_step() {   # run_step name needs_cuda command...
  local name="$1" needs_cuda="$2"; shift 2
  local limit="${LIMIT[$name]}" steplog="$OUT_DIR/$name.log"
  if [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  if [ "$needs_cuda" = 1 ] && [ "$DRY_RUN" = 1 ]; then
    log "$name: skipped (dry run)"; record "$name" skipped 0 0 "$limit" "dry run"; return
  fi
  if [ "$needs_cuda" = 1 ] && [ "$HAVE_CUDA" != 1 ]; then
    log "$name: skipped (no CUDA device)"; record "$name" skipped 0 0 "$limit" "no CUDA device"; return
  fi
  log "$name: start (limit ${limit}s)"
  local t0=$SECONDS rc status note=""
  # SIGINT first: pytest then still prints its summary and writes its junit XML.
  timeout -s INT -k 5 "$limit" "$@" > "$steplog" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout; note="killed after ${limit}s" ;;
    *) status=failed; note="exit $rc" ;;
  esac
  tail -n 3 "$steplog" | sed "s/^/  [$name] /" | tee -a "$LOG"
  log "$name: $status after $((SECONDS - t0))s"
  record "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$note"
}

PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -o addopts="" -q -rfE)

run_step env 0 "$PYTHON" "$REPO/tools/gpu/report.py" env --out "$OUT_DIR/env.json"
if [ -f "$OUT_DIR/env.json" ] && "$PYTHON" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))['cuda'] else 1)" "$OUT_DIR/env.json"; then
  HAVE_CUDA=1
elif [ "$DRY_RUN" = 0 ] && [[ ",$STEPS," != *",env,"* ]] && "$PYTHON" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  HAVE_CUDA=1
fi
if [ "$REHEARSAL" = 1 ] && [ "$HAVE_CUDA" != 1 ]; then   # the CUDA steps' plumbing, on the CPU
  HAVE_CUDA=1
  export DS_GPU_TESTS_ON_CPU=1
  BENCH_ARGS=(--dry-run)
  log "cpu rehearsal: CUDA steps run on the CPU (tests/gpu with DS_GPU_TESTS_ON_CPU=1, bench --dry-run)"
fi
run_step install 0 "$PYTHON" "$REPO/tools/gpu/install_wheels.py" --wheels "$WHEELS" --target "$PKGS/deps" \
  --ds-target "$PKGS/ds" --report "$OUT_DIR/install.json"
run_step import 0 "$PYTHON" "$REPO/tools/gpu/report.py" imports --repo "$REPO" --install "$OUT_DIR/install.json" \
  --ds-path "$DS_GPU_CHECK_DS_PATH"
run_step gpu-tests 1 "${PYTEST[@]}" -m gpu --junitxml "$OUT_DIR/gpu-tests.xml" "$REPO/tests/gpu" "$REPO/tests/unit"
# Not test_gpu_check.py (this script itself) nor test_progress.py (terminal subprocesses, no device use).
run_step unit-tests 1 "${PYTEST[@]}" -m "not gpu" --junitxml "$OUT_DIR/unit-tests.xml" "$REPO/tests/unit" \
  --ignore "$REPO/tests/unit/test_gpu_check.py" --ignore "$REPO/tests/unit/test_progress.py"
run_step bench 1 "$PYTHON" "$REPO/benchmarks/bench_gpu.py" --json "$OUT_DIR/bench.json" \
  --log "$OUT_DIR/bench-workers.log" --budget "$((LIMIT[bench] - 15))" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}

"$PYTHON" "$REPO/tools/gpu/report.py" summary --out "$OUT_DIR" --dry-run "$DRY_RUN" | tee -a "$LOG"
status=${PIPESTATUS[0]}
# --bundle: the device tool brings back at most 8 files, so everything but summary.md, results.json
# and check.log goes into one logs.tar.gz.
if [ "$BUNDLE" = 1 ]; then
  (cd "$OUT_DIR" && mapfile -t rest < <(ls -A | grep -vxE 'summary.md|results.json|check.log|logs.tar.gz') &&
   if [ "${#rest[@]}" -gt 0 ]; then tar czf logs.tar.gz "${rest[@]}" && rm -rf "${rest[@]}"; fi)
fi
exit "$status"
