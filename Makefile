# The two set-up commands of the README: `make demo` and `make test`.
# Each creates or updates .venv from the pinned requirements; a second run reuses it.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbridge-installed
EXAMPLES_STAMP := $(VENV)/.kvbridge-examples-installed
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvbridge-sglang-installed
# kvbridge's SGLang profiles against sglang 0.5.23's own code, inside sglang's environment.
SGLANG_TESTS := SGLANG_HOST_IP=127.0.0.1 PYTHONPATH=src $(SGLANG_VENV)/bin/python -m pytest tests/sglang_compat
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvbridge-vllm-installed
# kvbridge's vLLM connector inside vLLM 0.32's CPU build, next to vLLM's own NixlConnector;
# and the one-launch Triton staging kernels under Triton's interpreter (vLLM's environment
# has Triton, .venv does not).
VLLM_TESTS := $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/vllm_compat \
	tests/unit/test_staging_torch.py

.PHONY: demo test test-sglang test-vllm lint format docs bench mooncake sglang-env vllm-env goldens clean

$(STAMP): requirements/dev.txt requirements/engines.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kvbridge needs Python >= 3.10, $(PYTHON) is " + sys.version.split()[0])'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/engines.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

# torch for examples/ (the test suite runs the disaggregated-generation example).
$(EXAMPLES_STAMP): requirements/examples.txt $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/examples.txt
	@touch $@

# The Mooncake engine: installs its system library as root, else stops with the command.
mooncake: $(STAMP)
	scripts/install-mooncake.sh $(BIN)/python

# sglang 0.5.23 in its own environment (.venv-sglang), for the SGLang compatibility checks.
# Built after install-mooncake.sh has put libibverbs on the machine (sglang's Mooncake
# module loads it).
$(SGLANG_STAMP): scripts/sglang-env.sh tests/sglang_compat/sglang_import.py
	scripts/sglang-env.sh $(SGLANG_VENV)
	@touch $@

sglang-env: $(SGLANG_STAMP)

test-sglang: $(STAMP)
	scripts/install-mooncake.sh $(BIN)/python --optional
	$(MAKE) --no-print-directory $(SGLANG_STAMP)
	$(SGLANG_TESTS)

# vLLM 0.32.0's CPU build in its own environment (.venv-vllm) with kvbridge installed into it,
# for the vLLM connector's tests and benchmark. Built after install-mooncake.sh (Mooncake's
# system library).
$(VLLM_STAMP): scripts/vllm-env.sh scripts/vllm-test-files.sh pyproject.toml
	scripts/vllm-env.sh $(VLLM_VENV)
	@touch $@

vllm-env: $(VLLM_STAMP)

test-vllm: $(STAMP)
	scripts/install-mooncake.sh $(BIN)/python --optional
	$(MAKE) --no-print-directory $(VLLM_STAMP)
	$(VLLM_TESTS)

# Regenerate tests/goldens/sglang-0.5.23.json (and the samples made from it) from sglang.
goldens: $(STAMP) $(SGLANG_STAMP)
	PYTHONPATH=src $(SGLANG_VENV)/bin/python tests/sglang_compat/make_goldens.py
	$(BIN)/python scripts/make_samples.py

demo: $(STAMP)
	$(BIN)/kvbridge demo

test: $(STAMP) $(EXAMPLES_STAMP)
	scripts/install-mooncake.sh $(BIN)/python --optional
	$(MAKE) --no-print-directory $(SGLANG_STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check src tests benchmarks scripts examples
	$(BIN)/ruff format --check src tests benchmarks scripts examples
	$(BIN)/mypy --strict src
	$(BIN)/python -m pytest
	$(SGLANG_TESTS)
	$(VLLM_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts examples
	$(BIN)/mypy --strict src

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks scripts examples
	$(BIN)/ruff format src tests benchmarks scripts examples

# Benchmarks print numbers; nothing here is a timed assertion.
bench: $(STAMP)
	scripts/install-mooncake.sh $(BIN)/python --optional
	$(BIN)/python benchmarks/plan_128k.py
	$(BIN)/python benchmarks/wire_codec.py
	$(BIN)/python benchmarks/registration.py
	$(BIN)/python benchmarks/nixl_notify.py
	$(BIN)/python benchmarks/busy_host.py
	$(BIN)/python benchmarks/layerwise.py
	$(MAKE) --no-print-directory $(SGLANG_STAMP)
	$(BIN)/python benchmarks/e2e.py
	$(BIN)/python benchmarks/sglang_mooncake.py --compare 3
	$(BIN)/python benchmarks/sglang_mooncake.py --compare 3 --engine nixl
	$(BIN)/python benchmarks/hetero.py
	$(BIN)/kvbridge bench --preset quick
	$(MAKE) --no-print-directory $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python benchmarks/vllm_pd.py --quick
	for family in mla sliding mamba; do \
		$(VLLM_VENV)/bin/python benchmarks/vllm_pd.py --quick --family $$family || exit 1; done
	$(VLLM_VENV)/bin/python benchmarks/vllm_serve.py --quick
	$(BIN)/python -m kvbridge_tools.bench_report

docs: $(STAMP)
	$(BIN)/kvbridge protocol-doc --output docs/PROTOCOL.md

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .venv-vllm .pytest_cache .hypothesis
