#!/usr/bin/env bash
# Runs upstream DeepSpeed's own unit tests (tests/unit of a checkout of deepspeedai/DeepSpeed) against
# this package, on CPU, and writes a per-file pass count. Not part of `make test`.
#
#   make upstream-tests UPSTREAM=/path/to/DeepSpeed [UPSTREAM_SELECT="unit/runtime unit/checkpoint"]
#
# Own venv (.venv-upstream): torch, this package (editable), and the pytest that upstream's CI pins
# (>=7.2,<8.4: pytest 9.2 ignores how its harness registers DistributedFixture), with pytest-forked
# and pytest-xdist as its CPU workflow runs them (`pytest --forked unit/`), one test file per pytest, UPSTREAM_JOBS at a time.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
upstream="${UPSTREAM:?set UPSTREAM to a checkout of deepspeedai/DeepSpeed (its tests/ folder is used)}"
select="${UPSTREAM_SELECT:-}"
[ -n "$select" ] || [ -n "${UPSTREAM_IDS:-}" ] || select=unit   # default: all of unit/
jobs="${UPSTREAM_JOBS:-2}"
timeout_s="${UPSTREAM_TIMEOUT:-600}"
# UPSTREAM_VENV: an existing environment to run in instead (e.g. one with DeepSpeed itself installed,
# for the baseline that UPSTREAM_BASELINE compares against); it needs the same pytest plugins.
venv="${UPSTREAM_VENV:-$here/.venv-upstream}"
out="${UPSTREAM_OUT:-$here/runs/upstream-tests}"
python="${PYTHON:-python3}"
[ -d "$upstream/tests/unit" ] || { echo "UPSTREAM=$upstream has no tests/unit folder" >&2; exit 2; }

if [ -z "${UPSTREAM_VENV:-}" ] && [ ! -f "$venv/.installed" ]; then
    $python -m venv "$venv"
    "$venv/bin/pip" install -q "${TORCH:-torch==2.13.0}"
    "$venv/bin/pip" install -q -e "$here" "pytest==8.3.5" "pytest-forked==1.6.0" "pytest-xdist==3.6.1" \
        "pytest-timeout==2.3.1" numpy safetensors \
        hjson py-cpuinfo msgpack einops tensorboard transformers accelerate  # what upstream's tests import besides deepspeed
    touch "$venv/.installed"
fi
mkdir -p "$out/chunks"
rm -f "$out"/chunks/*
# The harness imports tests/unit/util.py etc. relative to tests/; run from there, as upstream's CI.
cd "$upstream/tests"
# One pytest per test file, $jobs at a time (not one xdist run over everything): a timeout inside
# upstream's DistributedFixture (it runs outside the forked test) is a pytest INTERNALERROR that ends
# the session, so it then loses one file, not the run. (~3 s of start-up per file.)
"$python" "$here/tools/upstream_tests/chunks.py" "$out/chunks" $select ${UPSTREAM_IDS:+--ids "$UPSTREAM_IDS"}
export PATH="$venv/bin:$PATH" LOCAL_SIZE="${UPSTREAM_LOCAL_SIZE:-4}" DS_ACCELERATOR=cpu HF_HOME="$out/hf_home" \
    TORCH_EXTENSIONS_DIR="$out/torch_extensions" venv out timeout_s
# LOCAL_SIZE: how many CPU "devices" the accelerator reports (upstream's harness skips world sizes above
# it; without it, the NUMA node count, usually 1): a 4-device node, as upstream's tests expect.
run_pytest() {   # ARGFILE JUNIT LOG
    # (to a file, not a pipe: a test's leftover worker processes would hold a pipe open after pytest exits)
    "$venv/bin/python" -m pytest --forked -p no:cacheprovider -q -o addopts="" --continue-on-collection-errors \
        --timeout="$timeout_s" --junitxml="$2" "@$1" > "$3" 2>&1
}
run_chunk() {
    local name; name="$(basename "$1" .args)"
    run_pytest "$1" "$out/chunks/$name.xml" "$out/chunks/$name.log"
    local rc=$? args="$1"
    if [ "$rc" = 4 ]; then   # a node id this environment does not collect (parametrized differently): whole file
        args="$out/chunks/$name.whole"
        head -n 1 "$1" | sed 's/::.*//' > "$args"
        run_pytest "$args" "$out/chunks/$name.xml" "$out/chunks/$name.log"
        rc=$?
    fi
    # exit 3: a timeout outside the forked test ended the file; run the rest without the hung test
    local part=0 resumed="" last="$out/chunks/$name.log"
    while [ "$rc" = 3 ] && [ "$part" -lt "${UPSTREAM_RESUMES:-8}" ]; do
        part=$((part + 1))
        local log="$out/chunks/$name.log"; [ "$part" -gt 1 ] && log="$out/chunks/$name.r$((part - 1)).log"
        "$venv/bin/python" "$here/tools/upstream_tests/resume.py" "$args" "$out/chunks/$name.r$part.resume" \
            "$out/chunks/$name.hung$part.xml" "$log" "$out/chunks/$name".*xml || break
        run_pytest "$out/chunks/$name.r$part.resume" "$out/chunks/$name.r$part.xml" "$out/chunks/$name.r$part.log"
        rc=$?
        resumed=" after $part resume(s)" last="$out/chunks/$name.r$part.log"
    done
    echo "$name: exit $rc$resumed ($(tail -n 1 "$last" | sed 's/\x1b\[[0-9;]*m//g'))"
}
export here
export -f run_pytest run_chunk
set +e
ls "$out"/chunks/*.args | xargs -d '\n' -n 1 -P "$jobs" bash -c 'run_chunk "$0"' | tee "$out/pytest.log"
set -e
"$python" "$here/tools/upstream_tests/report.py" "$out"/chunks/*.xml \
    ${UPSTREAM_BASELINE:+--baseline $UPSTREAM_BASELINE} | tee "$out/per_file.md"   # baseline unquoted: a glob of junit files
