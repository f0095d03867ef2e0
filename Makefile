# Two commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip --upgrade
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deepspeed --num_gpus 2 examples/gpt/train.py \
	    --deepspeed --deepspeed_config examples/gpt/ds_config.json

test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests

bench: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) benchmarks/bench_dp.py

clean:
	rm -rf $(VENV) build *.egg-info
