# The two set-up commands of the README: `make demo` and `make test`.
# Set-up installs the versions pinned in requirements/lock.txt (see docs/getting-started.md, "Versions").
VENV ?= .venv
LATEST_VENV ?= .venv-latest
VLLM_VENV ?= .venv-vllm
ARGS ?=
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# make test: one pytest worker per usable core (pytest-xdist; `auto` follows taskset), at most 4.
PYTEST_WORKERS ?= auto
PYTEST_MAX_WORKERS ?= 4

.PHONY: demo test docs venv-docs test-matrix test-slow test-all test-latest lock bench bench-inference lint venv venv-dev clean device-bundle

venv:
	@bash scripts/setup_venv.sh $(VENV) hf,plot

venv-dev:
	@bash scripts/setup_venv.sh $(VENV) dev

venv-docs:
	@bash scripts/setup_venv.sh $(VENV) dev,docs

## Run the main job (analysis + short training bench) on the embedded default dataset.
demo: venv
	HF_HUB_OFFLINE=1 $(PY) -m smart_batching demo

## Run the default test suite (under 10 minutes on 2 CPU cores, set-up included), on every usable core.
## PYTEST_WORKERS=0 runs it in one process.
test: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --maxprocesses=$(PYTEST_MAX_WORKERS) $(PYTEST_ARGS)

## The documentation site (mkdocs.yml, docs/): built strictly into out/site (a broken link or reference
## fails), then rendered in headless Chromium (tests/test_docs_browser.py). Debian's chromium is installed
## first only where it is missing and this runs as root with apt-get; elsewhere the browser check skips.
docs: venv-docs
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "docs: installing Debian's chromium for the browser check"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } \
	  || echo "docs: chromium could not be installed; the browser check will skip"; fi
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_docs_browser.py

## The default suite under each machine setting of CONTRIBUTING's matrix (1 core, 1 thread, oneDNN off or
## capped, each forced CPU bf16 path), one after another. MATRIX="omp-1 half-native" runs some.
test-matrix: venv-dev
	@PY=$(PY) PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test_matrix.sh

## Slow tier: real pretrained models, large inputs.
test-slow: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: venv-dev
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "slow or not slow" $(PYTEST_ARGS)

## Forward-compatibility check: the default suite on the newest releases of the HF stack, in
## $(LATEST_VENV) (not the lock). Not part of .ci/run.
test-latest:
	@PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/lock.sh $(LATEST_VENV)

## Regenerate requirements/lock.txt: newest releases, default suite, and the lock written only if it passed.
lock:
	@PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/lock.sh $(LATEST_VENV) --write requirements/lock.txt

bench: venv-dev
	HF_HUB_OFFLINE=1 $(PY) benchmarks/planner_speed.py

## Inference benchmark (engines side by side) in $(VLLM_VENV): vLLM with the library installed
## without the lock, since vLLM pins its own transformers. `make bench-inference ARGS=--json`.
bench-inference:
	@bash scripts/setup_vllm_venv.sh $(VLLM_VENV)
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python benchmarks/inference.py $(ARGS)

## Wheels and token lengths for the GPU check (scripts/device_check.sh, CONTRIBUTING.md "GPU check"),
## in .device-bundle/ (carried beside the tree; under 55 MiB). Needs the dev venv (`make venv-dev`, or
## VENV=path/to/one) and PyPI.
device-bundle:
	@PY=$(PY) bash scripts/device_bundle.sh

lint: venv-dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(VLLM_VENV) out/site build dist src/*.egg-info .pytest_cache
