# Two commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean upstream-tests gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --upgrade
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The demo trains 150 steps and saves (as if interrupted), resumes from the checkpoint to step
# 300, then consolidates the ZeRO-2 checkpoint into one fp32 state dict with the zero_to_fp32.py
# that save_checkpoint placed beside it.
DEMO_RUN := runs/gpt
demo: $(STAMP)
	rm -rf $(DEMO_RUN)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deepspeed --num_gpus 2 examples/gpt/train.py \
	    --deepspeed --deepspeed_config examples/gpt/ds_config.json --save-dir $(DEMO_RUN) --stop-after 150 \
	    --sample-len 0
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deepspeed --num_gpus 2 examples/gpt/train.py \
	    --deepspeed --deepspeed_config examples/gpt/ds_config.json --save-dir $(DEMO_RUN) --resume
	$(PY) $(DEMO_RUN)/zero_to_fp32.py $(DEMO_RUN) $(DEMO_RUN)/fp32

test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests

# Upstream DeepSpeed's own unit tests against this package (docs/compatibility.md); not in `make test`.
# UPSTREAM=/path/to/DeepSpeed checkout; UPSTREAM_SELECT picks folders/files under its tests/.
upstream-tests:
	UPSTREAM="$(UPSTREAM)" bash tools/upstream_tests/run.sh

# The one-call CUDA check for a session lent a GPU (docs/gpu.md). No $(STAMP): the device copy of
# the tree has no .venv, so it runs with the image's python (PYTHON=... to choose one) and the
# wheels carried in .whl/ (tools/gpu/fetch_wheels.sh). GPU_CHECK_ARGS=--dry-run checks the plumbing;
# GPU_CHECK_ARGS="--bundle --cpu-rehearsal" runs every step on the CPU (minutes).
GPU_CHECK_ARGS ?= --bundle
gpu-check:
	bash tools/gpu/check.sh $(GPU_CHECK_ARGS)

bench: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_dp.py

clean:
	rm -rf $(VENV) .venv-upstream build *.egg-info
