#!/usr/bin/env bash
# Build a separate venv with the real DeepSpeed 0.19.8 (CPU only) for side-by-side benchmarks.
#
#   benchmarks/ds_venv.sh                 # -> /tmp/ds-venv
#   DS_VENV=/tmp/other benchmarks/ds_venv.sh
#
# Idempotent: re-running only installs what is missing. Steps:
#   1. python3 -m venv $DS_VENV (never inside this repository)
#   2. torch==2.13.0, pinned exactly: any other torch spec pulls the CUDA wheels (gigabytes)
#   3. DS_BUILD_OPS=0 deepspeed==0.19.8: no ops compiled at install time; its requirements
#      (hjson, py-cpuinfo, ninja, msgpack, einops, numpy, psutil, pydantic, packaging, tqdm)
#      are all it needs to import and train on CPU
#   4. prebuild the one op DeepSpeed JIT-compiles on CPU at init_distributed (the shared-
#      memory all-reduce, deepspeed_shm_comm; 1.5-3.5 minutes on 2 cores) into
#      $DS_VENV/torch_extensions. bench_zero.py copies it into a private TORCH_EXTENSIONS_DIR
#      per job, so jobs neither rebuild it nor share a JIT lock (a shared one once hung
#      deepspeed.initialize for 10 minutes).
#   5. check: import deepspeed, and a 2-rank all_reduce via `deepspeed --num_gpus 2`.
#
# DeepSpeed's CPU comm backend leaves /dev/shm/deepspeed_allreduce_buffer_* files (69 MB each,
# two per job, never freed). This script removes the ones its check creates; bench_zero.py
# removes those of its own jobs.
set -euo pipefail

DS_VENV="${DS_VENV:-/tmp/ds-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
DS_SPEC="deepspeed==0.19.8"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

DS_VENV_ABS="$(realpath -m "$DS_VENV")"
case "$DS_VENV_ABS/" in
  "$REPO"/*) echo "DS_VENV=$DS_VENV is inside the repository; use a path outside it (default /tmp/ds-venv)" >&2; exit 2 ;;
esac

log() { echo "[ds_venv] $*"; }

if [ ! -x "$DS_VENV/bin/python" ]; then
  log "creating venv $DS_VENV"
  "$PYTHON" -m venv "$DS_VENV"
fi
PY="$DS_VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

log "installing $TORCH_SPEC"
"${PIP[@]}" install -q "$TORCH_SPEC"
log "installing $DS_SPEC (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "${PIP[@]}" install -q "$DS_SPEC"

# deepspeed's requirements must not have moved torch off the pinned version.
"$PY" - <<'EOF'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} installed; expected 2.13.0"
EOF

# Run everything below from outside the repo: `python -m deepspeed...` puts the working
# directory first on sys.path, which from the repo root would import *our* package.
WORK="$(mktemp -d /tmp/ds_venv_check.XXXXXX)"
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cleanup() {
  rm -f /dev/shm/deepspeed_allreduce_buffer_*_"$PORT"_* 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
cd "$WORK"
unset PYTHONPATH

EXT="$DS_VENV/torch_extensions"
if [ ! -f "$EXT/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
  log "prebuilding the CPU shm comm op into $EXT (a few minutes)"
  rm -rf "$EXT.tmp" && mkdir -p "$EXT.tmp"
  TORCH_EXTENSIONS_DIR="$EXT.tmp" timeout 1800 "$PY" - <<'EOF'
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
assert b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False), "shm comm op not compatible"
print("built", b.load())
EOF
  rm -f "$EXT.tmp"/*/lock
  rm -rf "$EXT" && mv "$EXT.tmp" "$EXT"
fi

log "checking import"
"$PY" - <<'EOF'
import deepspeed, torch
assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
from deepspeed.accelerator import get_accelerator
print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}; torch {torch.__version__}; "
      f"accelerator {get_accelerator().device_name()} / {get_accelerator().communication_backend_name()}")
EOF

log "checking the launcher: deepspeed --num_gpus 2 (CPU, gloo)"
cp -r "$EXT" "$WORK/ext"
cat > "$WORK/check.py" <<'EOF'
import deepspeed, torch
deepspeed.init_distributed(dist_backend="gloo")
import torch.distributed as dist
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 4, t
print(f"rank {dist.get_rank()}/{dist.get_world_size()} all_reduce ok ({deepspeed.__file__})", flush=True)
dist.destroy_process_group()
EOF
rc=0
TORCH_EXTENSIONS_DIR="$WORK/ext" OMP_NUM_THREADS=1 timeout 600 \
  "$DS_VENV/bin/deepspeed" --num_gpus 2 --master_port "$PORT" "$WORK/check.py" > "$WORK/launch.log" 2>&1 || rc=$?
if [ "$rc" -ne 0 ] || [ "$(grep -c 'all_reduce ok' "$WORK/launch.log")" -ne 2 ]; then
  tail -30 "$WORK/launch.log" >&2
  echo "[ds_venv] launcher check FAILED (exit $rc)" >&2
  exit 1
fi
grep 'all_reduce ok' "$WORK/launch.log"
log "ok: $DS_VENV"
