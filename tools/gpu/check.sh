#!/usr/bin/env bash
# The whole CUDA check in one call, for a session lent a GPU machine (docs/gpu.md):
#
#   bash tools/gpu/check.sh                 # what `make gpu-check` runs; <= 8 minutes on one H100
#   bash tools/gpu/check.sh --dry-run       # plumbing only (CPU, seconds): CUDA steps reported skipped
#   bash tools/gpu/check.sh --cpu-rehearsal # every step on the CPU (gloo, the CPU standing in for cuda): minutes
#   bash tools/gpu/check.sh --steps env,install,import,gpu-tests --out /tmp/x --wheels /path/to/.whl
#
# Steps, each under its own `timeout` (a hang costs that step, not the call):
#   env        python, torch, CUDA, device name (env.json)
#   install    wheels from .whl/ into a temporary target dir on PYTHONPATH, never the system
#              (tools/gpu/install_wheels.py; DeepSpeed 0.19.8 into a dir of its own)
#   import     this package imports with them; DeepSpeed 0.19.8 imports alone from its dir
#   ds-build   tools/gpu/ds_build.py in the background (overlapping the next three steps): DeepSpeed
#              0.19.8's FusedAdam (when nvcc exists) and CPU Adam ops, for the bench's DeepSpeed rows
#   gpu-tests  pytest -m gpu tests/gpu tests/unit             (needs CUDA)
#   unit-tests pytest tests/unit -m "not gpu": the in-process suite with CUDA visible (needs CUDA)
#   features   tools/gpu/features.py: ZeRO-3, offload, SP, ALST, AutoTP, MoE, Muon, ZeRO++ at world
#              size 1 on NCCL, each against the same run on the CPU (needs CUDA)
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
STEPS="env,install,import,ds-build,gpu-tests,unit-tests,features,bench"
ALL_STEPS=" env install import ds-build gpu-tests unit-tests features bench "
# Seconds per step (docs/gpu.md, "Time budget"): 15+30+35 + 75+60+55 + 160 = 430 in sequence, each
# killed 5 s after its limit (+35); ds-build (200) runs beside gpu-tests+unit-tests+features (190+15)
# and is waited for before bench, so it adds nothing to the worst case: 430 + 35 = 465 s < 8 minutes.
# --cpu-rehearsal doubles every limit not set by --limit (2 busy CPU cores stand in for a GPU machine).
declare -A LIMIT=([env]=15 [install]=30 [import]=35 [ds-build]=200 [gpu-tests]=75 [unit-tests]=60 [features]=55
                  [bench]=160)
declare -A LIMIT_SET=()

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
      LIMIT[${BASH_REMATCH[1]}]="${BASH_REMATCH[2]}"; LIMIT_SET[${BASH_REMATCH[1]}]=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check.sh: unknown argument '$1' (allowed: --dry-run, --cpu-rehearsal, --bundle, --out DIR, --wheels DIR, --steps LIST, --limit step=S, --help)" >&2; exit 2 ;;
  esac
  shift
done
for s in ${STEPS//,/ }; do
  [[ "$ALL_STEPS" == *" $s "* ]] || { echo "check.sh: --steps: unknown step '$s' (allowed:$ALL_STEPS)" >&2; exit 2; }
done
if [ "$REHEARSAL" = 1 ]; then
  for s in "${!LIMIT[@]}"; do [ -n "${LIMIT_SET[$s]:-}" ] || LIMIT[$s]=$((2 * LIMIT[$s])); done
fi

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
rm -f "$OUT_DIR"/{env,install,bench,features,ds-build,results}.json "$OUT_DIR"/*-tests.xml "$OUT_DIR"/summary.md \
      "$OUT_DIR"/{env,install,import,ds-build,gpu-tests,unit-tests,features,features-workers,bench,bench-workers}.log \
      "$OUT_DIR"/logs.tar.gz   # no stale results
log() { echo "[gpu-check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
log "repo $REPO, python $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])')), out $OUT_DIR, wheels $WHEELS, dry_run $DRY_RUN"

export PYTHONPATH="$REPO:$PKGS/deps${PYTHONPATH:+:$PYTHONPATH}"
export DS_GPU_CHECK_DS_PATH="$PKGS/ds:$PKGS/deps"   # bench_gpu.py's DeepSpeed subprocess path
export PATH="$PKGS/deps/bin:$PATH"   # the ninja wheel's binary: torch's JIT builds look for it on PATH
export PYTHONDONTWRITEBYTECODE=1
export TORCH_EXTENSIONS_DIR="$PKGS/torch_extensions"   # ds-build's ops, loaded by the bench's DeepSpeed rows
export DS_GPU_CHECK_DS_BUILD="$OUT_DIR/ds-build.json"
ORIG_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-}"
HAVE_CUDA=0
FEATURE_ARGS=()
DS_BUILD_ARGS=()

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
  FEATURE_ARGS=(--cpu-rehearsal)
  DS_BUILD_ARGS=(--dry-run)
  log "cpu rehearsal: CUDA steps run on the CPU (tests/gpu with DS_GPU_TESTS_ON_CPU=1, features --cpu-rehearsal," \
      "bench --dry-run, ds-build --dry-run)"
fi
if [ "$HAVE_CUDA" = 1 ] && [ "$REHEARSAL" != 1 ] && [ -f "$OUT_DIR/env.json" ]; then
  # DeepSpeed's JIT builds (ds-build) and loads (bench) for this device's architecture only, and with the
  # same list, so the bench finds ds-build's ops instead of rebuilding (an image may set a long list)
  cap="$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1])).get('capability') or '')" "$OUT_DIR/env.json")"
  if [ -n "$cap" ]; then export TORCH_CUDA_ARCH_LIST="$cap"; log "TORCH_CUDA_ARCH_LIST=$cap (was '${ORIG_ARCH_LIST:-}')"; fi
fi
run_step install 0 "$PYTHON" "$REPO/tools/gpu/install_wheels.py" --wheels "$WHEELS" --target "$PKGS/deps" \
  --ds-target "$PKGS/ds" --report "$OUT_DIR/install.json"
run_step import 0 "$PYTHON" "$REPO/tools/gpu/report.py" imports --repo "$REPO" --install "$OUT_DIR/install.json" \
  --ds-path "$DS_GPU_CHECK_DS_PATH"
# ds-build: in the background, beside the test steps; waited for before bench.
DS_BUILD_PID=""
ds_build_start() {
  local name=ds-build limit="${LIMIT[ds-build]}"
  if [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  if [ "$DRY_RUN" = 1 ]; then log "$name: skipped (dry run)"; record "$name" skipped 0 0 "$limit" "dry run"; return; fi
  if [ "$HAVE_CUDA" != 1 ]; then log "$name: skipped (no CUDA device)"; record "$name" skipped 0 0 "$limit" "no CUDA device"; return; fi
  if ! "$PYTHON" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('deepspeed_wheel') else 1)" \
       "$OUT_DIR/install.json" 2>/dev/null; then
    log "$name: skipped (no DeepSpeed wheel installed)"; record "$name" skipped 0 0 "$limit" "no DeepSpeed wheel"; return
  fi
  log "$name: start in the background (limit ${limit}s)"
  DS_BUILD_T0=$(date +%s)
  # MAX_JOBS: half the compile jobs torch would start, so the test steps beside it keep cores
  (cd "$PKGS" && PYTHONPATH="$DS_GPU_CHECK_DS_PATH" MAX_JOBS="${MAX_JOBS:-4}" timeout -s INT -k 5 "$limit" "$PYTHON" "$REPO/tools/gpu/ds_build.py" \
     --report "$DS_GPU_CHECK_DS_BUILD" ${DS_BUILD_ARGS[@]+"${DS_BUILD_ARGS[@]}"} > "$OUT_DIR/$name.log" 2>&1
   rc=$?; date +%s > "$PKGS/ds-build.end"; exit $rc) &
  DS_BUILD_PID=$!
}
ds_build_wait() {
  [ -n "$DS_BUILD_PID" ] || return 0
  local rc status note="" limit="${LIMIT[ds-build]}"
  wait "$DS_BUILD_PID"; rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout; note="killed after ${limit}s" ;; *) status=failed; note="exit $rc" ;; esac
  tail -n 2 "$OUT_DIR/ds-build.log" | cut -c1-300 | sed "s/^/  [ds-build] /" | tee -a "$LOG"
  local took=$(( $(cat "$PKGS/ds-build.end" 2>/dev/null || date +%s) - DS_BUILD_T0 ))
  log "ds-build: $status after ${took}s (in the background)"
  record ds-build "$status" "$rc" "$took" "$limit" "${note:-in the background}"
}
ds_build_start
run_step gpu-tests 1 "${PYTEST[@]}" -m gpu --junitxml "$OUT_DIR/gpu-tests.xml" "$REPO/tests/gpu" "$REPO/tests/unit"
# Not test_gpu_check.py (this script itself) nor test_progress.py (terminal subprocesses, no device use).
run_step unit-tests 1 "${PYTEST[@]}" -m "not gpu" --junitxml "$OUT_DIR/unit-tests.xml" "$REPO/tests/unit" \
  --ignore "$REPO/tests/unit/test_gpu_check.py" --ignore "$REPO/tests/unit/test_progress.py"
run_step features 1 "$PYTHON" "$REPO/tools/gpu/features.py" --json "$OUT_DIR/features.json" \
  --log "$OUT_DIR/features-workers.log" --budget "$((LIMIT[features] - 5))" ${FEATURE_ARGS[@]+"${FEATURE_ARGS[@]}"}
ds_build_wait
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
