# The two set-up commands of the README: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-slow test-all bench lint venv venv-dev clean

venv:
	@bash scripts/setup_venv.sh $(VENV) hf,plot

venv-dev:
	@bash scripts/setup_venv.sh $(VENV) dev

## Run the main job (analysis + short training bench) on the embedded default dataset.
demo: venv
	HF_HUB_OFFLINE=1 $(PY) -m smart_batching demo

## Run the default test suite (under 10 minutes on 2 CPU cores).
test: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

## Slow tier: real pretrained models, large inputs.
test-slow: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

bench: venv-dev
	HF_HUB_OFFLINE=1 $(PY) benchmarks/planner_speed.py

lint: venv-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
