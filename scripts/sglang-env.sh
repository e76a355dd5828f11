#!/usr/bin/env bash
# A separate environment holding sglang 0.5.23's PD-disaggregation code, to check kvbridge's
# SGLang profiles against sglang itself (tests/sglang_compat, run by `make test`). It is kept apart
# from .venv: it is heavy (about 2.4 GB; 2-3 minutes to build with pip's cache warm) and pins
# its own transformers.
# What it takes on a CPU-only machine is in ../shared/reference/sglang-cpu.md; importing sglang
# also needs tests/sglang_compat/sglang_import.py's stand-ins for torchvision's native operators.
#
#   scripts/sglang-env.sh [VENV]      (default .venv-sglang; `make sglang-env` runs it)
set -euo pipefail
venv=${1:-.venv-sglang}
python=${PYTHON:-python3}
test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --no-deps sglang==0.5.23 mooncake-transfer-engine-non-cuda==0.3.13.post1
# sglang's NIXL backend imports `nixl._api`: the meta package over the build kvbridge uses
# (requirements/engines.txt), the same binaries on both sides of the live tests.
"${pip[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"${pip[@]}" torch==2.13.0  # the machine's local CPU wheel (sglang declares 2.14.1; 2.13 works)
"${pip[@]}" numpy msgspec pyzmq requests aiohttp orjson psutil pybase64 packaging pillow \
    starlette pydantic tqdm ipython prometheus_client dill gguf sentencepiece==0.2.1 \
    apache-tvm-ffi==0.1.11 transformers==5.19.0 compressed-tensors==0.18.0 torch==2.13.0
# sglang.srt.utils imports triton; sglang.srt.configs imports torchvision.transforms, whose
# only 0.28 wheels are CUDA builds: installed without their dependencies, their native
# operators stubbed at import (tests/sglang_compat/sglang_import.py).
"${pip[@]}" --no-deps triton==3.7.0 torchvision==0.28.0
# What tests/sglang_compat runs with (the versions of requirements/dev.txt).
"${pip[@]}" pytest==9.2.0 pytest-timeout==2.4.0 hypothesis==6.168.5
"$venv/bin/python" "$(dirname "$0")/../tests/sglang_compat/sglang_import.py"
