"""Run vLLM 0.32's CPU build on a random-weight Llama made here (run inside .venv-vllm, which
scripts/vllm-env.sh builds): the ground the kvbridge vLLM connector's tests stand on.

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python tests/vllm_compat/vllm_probe.py

Prints the greedy tokens of a few prompts and how long start-up and generation took.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_harness import make_model


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    # With a path argument: load tests/vllm_compat/recording_connector.py into vLLM and write
    # what it is called with to that JSON-lines file.
    record = sys.argv[1] if len(sys.argv) > 1 else None
    transfer = None
    if record is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        transfer = KVTransferConfig(
            kv_connector="RecordingConnector",
            kv_connector_module_path="recording_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"record": record},
        )
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        model = make_model(Path(folder))
        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            block_size=32,
            max_model_len=4096,
            kv_cache_memory_bytes=256 << 20,
            dtype="bfloat16",
            enforce_eager=True,
            kv_transfer_config=transfer,
            disable_hybrid_kv_cache_manager=transfer is not None,
        )
        ready = time.perf_counter()
        prompts = [
            {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(n)]}
            for i, n in enumerate((5, 32, 97, 300))
        ]
        params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
        outputs = llm.generate(prompts, params)
        done = time.perf_counter()
    for output in outputs:
        print(len(output.prompt_token_ids), list(output.outputs[0].token_ids))
    print(f"start-up {ready - started:.1f} s, generation {done - ready:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
