# `make run` and `make test` are the two entry points; both set up everything they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup dev lint typecheck pytest services vllm-venv sglang-venv bench clean

run: $(STAMP)
	$(BIN)/kvledger --help
	mkdir -p -m 700 kvledger-data  # --dump-state refuses a missing folder; owner-only, as kvledger makes it
	$(BIN)/kvledger simulate --requests 1000 --g2-blocks 1024 --g3-blocks 4096 \
	    --log sqlite:///kvledger-data/run.db --dump-state kvledger-data/run.state
	$(BIN)/kvledger replay kvledger-data/run.db --verify kvledger-data/run.state

# The environments are set up side by side (the vLLM one does not need the project's), and
# ruff and mypy run as soon as the project's is ready, while the vLLM one is still building;
# then the tests. On two cores this takes minutes off a fresh machine's run.
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target setup lint typecheck
	$(MAKE) --no-print-directory pytest

setup: $(STAMP) services vllm-venv sglang-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: a plain `pip install torch` elsewhere pulls a multi-GB CUDA build. Without a CUDA
# driver we want the CPU wheel (pinned to the release the project is tested with). Then the
# project with the extras the suite needs: torch (the tiers), dev (tests, linters, references).
$(STAMP): pyproject.toml setup.py events/_speedups.c registry/fields.h registry/_records.c events/log/_sqlite.c events/log/_gather.c events/log/rowblock.h events/records.h events/crc32.h registry/_pool.c registry/_index.c registry/_chain.c kvledger/mocker/_trace.c | $(BIN)/python
	@bash .ci/build-deps  # a C compiler, for the compiled encoder, queue, writer and pool
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	    $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e '.[torch,dev]' --config-settings editable_mode=strict
	@touch $(STAMP)

# Re-link the editable install after adding a module (strict editable mode links files one by one).
dev: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=strict

services:
	@bash .ci/services

# vLLM 0.33 with its own offloading tests, which the suite runs against kvledger's spec
# (tests/integrations/test_vllm_offloading.py). A few minutes the first time.
VLLM_VENV := .vllm-test-venv
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: tests/integrations/setup_vllm_test_venv.sh bench/setup_bench_venv.sh pyproject.toml
	bash tests/integrations/setup_vllm_test_venv.sh $(VLLM_VENV)
	@touch $@

# SGLang 0.5.23 layered over $(VENV) (its own site-packages holds only SGLang and the modules its
# HiCache storage import needs), in which the suite runs kvledger's SGLang backend tests
# (tests/integrations/test_sglang_hicache.py). 15 to 30 s.
SGLANG_VENV := .sglang-test-venv
sglang-venv: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: tests/integrations/setup_sglang_test_venv.sh pyproject.toml $(STAMP)
	bash tests/integrations/setup_sglang_test_venv.sh $(SGLANG_VENV) $(VENV)
	@touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Run from inside the venv folder: from the repository root, the kvledger/ folder would shadow
# the installed package and mypy would see only the face, not registry/, events/, tiers/.
# The tests are checked against that installed package; their shared helpers (conftest,
# services, event_streams) resolve because mypy searches the folder of the files it is given.
typecheck: dev
	cd $(VENV) && bin/mypy --config-file ../pyproject.toml -p kvledger
	cd $(VENV) && bin/mypy --config-file ../pyproject.toml ../tests

# Two workers, each taking whole test files (module fixtures such as a Redis Cluster start
# once): half the suite's time is spent waiting on the servers and workers its tests start, so
# two workers fit on two cores. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
pytest: dev
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python bench/hash_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info kvledger-data \
	    .pytest_cache .mypy_cache .ruff_cache
