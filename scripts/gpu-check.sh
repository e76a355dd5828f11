#!/usr/bin/env bash
# The GPU check, run on the lent GPU machine from the repository root, with `.whl/site`
# (built here by scripts/gpu_site.py) carried along: the CUDA cases of the test suite, then
# benchmarks/gpu_check.py. Its output and JSON land in $OUT when that is set.
#
#   scripts/gpu-check.sh            # at most 8 minutes (both parts have timeouts)
set -uo pipefail
site=$PWD/.whl/site
if [ ! -d "$site/nixl_cu12" ]; then
  echo "error: $site is missing; build it with: python scripts/gpu_site.py (and carry .whl/site)" >&2
  exit 2
fi
out=${OUT:-bench-results}
mkdir -p "$out"
export PYTHONPATH=$site:$PWD/src PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$site/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$python" - <<'EOF'
import nixl_cu12, numpy, torch, zmq
print(f"python ok: torch {torch.__version__} (cuda {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}), "
      f"numpy {numpy.__version__}, pyzmq {zmq.__version__}")
EOF
status=0
timeout 200 "$python" -m pytest -p no:cacheprovider -q -rs --timeout 120 \
  tests/unit/test_staging_torch.py tests/unit/test_vllm_cache.py \
  "tests/integration/test_transfer.py::test_torch_tensors_arrive_byte_exact" \
  2>&1 | tee "$out/gpu-tests.txt" || status=1
timeout 260 "$python" benchmarks/gpu_check.py 2>&1 | tee "$out/gpu-check.txt" || status=1
cp bench-results/gpu_check.json "$out/" 2>/dev/null || true
exit $status
