"""One vLLM instance (vLLM 0.32's CPU build, in-process engine) driven by JSON lines: the
prefill, decode or plain instance of the vLLM tests and benchmark.

    instance.py MODEL_DIR '{"kv_connector": "KVBridgeConnector", ...}' | 'null'

Environment: KVBRIDGE_TEST_TP and KVBRIDGE_TEST_PP (tensor- and pipeline-parallel sizes,
default 1), KVBRIDGE_TEST_DTYPE (default bfloat16), KVBRIDGE_TEST_MAX_MODEL_LEN,
KVBRIDGE_TEST_KV_BYTES (KV cache bytes), KVBRIDGE_TEST_BLOCK_SIZE (default 32; "auto": vLLM's
choice), KVBRIDGE_TEST_PREFIX_CACHING=0 (prefix caching off), KVBRIDGE_TEST_MAX_NUM_SEQS
(requests running at once), KVBRIDGE_TEST_MAX_BATCHED_TOKENS (tokens a step computes: below a
prompt's length, its prefill goes in chunks), KVBRIDGE_TEST_LOG_LEVEL (kvbridge's log level),
KVBRIDGE_TEST_KV_BLOCKS=1 (each output carries `kv_blocks`: per KV cache group, a hash of each
block the prompt fills over the group's attention layers, read when the request ends, on rank
0; `kv_blocks_by_rank`: the same on every TP rank).

Commands on stdin, one JSON object per line; each answer is one line on stdout starting with
``@@`` (vLLM and kvbridge log to stderr):
- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n, "params": [kv_transfer_params]}``
  (max_tokens: one for all, or a list)
  → ``{"outputs": [{"tokens", "kv_transfer_params", "finish_reason", "ttft_s"}], "wall_s"}``
- ``{"op": "submit", ...same...}`` adds the requests and answers at once; ``{"op": "abort"}``
  aborts every submitted request still running (``"indices"``: only those of them);
  ``{"op": "collect"}`` waits for them (``"indices"``: for those; an aborted one never ends).
- ``{"op": "offline", ...as generate...}`` → ``{"outputs": [{"tokens", "params"}]}``
  (params: kv_transfer_params) through vLLM's offline ``LLM.generate``; the engine then
  takes no step until a generate, submit or collect (an application's loop stops once its
  outputs are out).
- ``{"op": "stats"}`` → free KV blocks, the connector's counters.
- ``{"op": "reset_prefix_cache"}`` → ``{"reset": bool}``: vLLM drops its cached blocks (no
  request may be running), so the same prompts again are computed or loaded anew.
Between commands the engine keeps stepping while the scheduler has work (a prefill instance
frees a request's blocks only once decode has them), as `vllm serve`'s engine loop does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

BLOCK_SIZE = os.environ.get("KVBRIDGE_TEST_BLOCK_SIZE", "32")
# The benchmark's 8k prompts plus their output need more than 8192: it sets this higher.
MAX_MODEL_LEN = int(os.environ.get("KVBRIDGE_TEST_MAX_MODEL_LEN", 8192))
# TP > 1: one worker process per rank (vLLM's "mp" executor), each running its own connector.
TP = int(os.environ.get("KVBRIDGE_TEST_TP", 1))
PP = int(os.environ.get("KVBRIDGE_TEST_PP", 1))
DTYPE = os.environ.get("KVBRIDGE_TEST_DTYPE", "bfloat16")


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    import logging

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.sampling_params import RequestOutputKind

    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )
    model, transfer_json = sys.argv[1], sys.argv[2]
    transfer = json.loads(transfer_json)
    kv_transfer_config = KVTransferConfig(**transfer) if transfer else None
    started = time.perf_counter()
    block_size = {} if BLOCK_SIZE == "auto" else {"block_size": int(BLOCK_SIZE)}
    if os.environ.get("KVBRIDGE_TEST_PREFIX_CACHING") == "0":
        block_size["enable_prefix_caching"] = False
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        **block_size,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=int(os.environ.get("KVBRIDGE_TEST_KV_BYTES", 256 << 20)),
        dtype=DTYPE,
        enforce_eager=True,
        kv_transfer_config=kv_transfer_config,
        seed=0,
        tensor_parallel_size=TP,
        pipeline_parallel_size=PP,
        **(
            {"max_num_seqs": int(os.environ["KVBRIDGE_TEST_MAX_NUM_SEQS"])}
            if "KVBRIDGE_TEST_MAX_NUM_SEQS" in os.environ
            else {}
        ),
        **(
            {"max_num_batched_tokens": int(os.environ["KVBRIDGE_TEST_MAX_BATCHED_TOKENS"])}
            if "KVBRIDGE_TEST_MAX_BATCHED_TOKENS" in os.environ
            else {}
        ),
        distributed_executor_backend="mp" if TP * PP > 1 else None,
    )
    # kvbridge logs through vLLM's handlers at vLLM's level; DEBUG here traces every room.
    if level := os.environ.get("KVBRIDGE_TEST_LOG_LEVEL"):
        logging.getLogger("kvbridge").setLevel(level)
        for handler in logging.getLogger("kvbridge").handlers:  # vLLM's, in milliseconds
            handler.setLevel(level)
            handler.setFormatter(
                logging.Formatter("%(asctime)s.%(msecs)03d %(message)s", "%H:%M:%S")
            )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    submitted: list[str] = []
    finished: dict[str, Any] = {}
    # When each request was added and when its first token came out (time to first token).
    added_at: dict[str, float] = {}
    first_token_at: dict[str, float] = {}
    # When vLLM's scheduler heard that a request's KV was in place (the connector reported it
    # in finished_recving): the transfer plane's part of the time to first token, seen the
    # same way for every connector.
    kv_ready_at: dict[str, float] = {}
    hear_finished = scheduler._update_from_kv_xfer_finished

    # Each loaded request's recurrent state as its load ends, before decode computes on it.
    loaded_states: dict[str, list[dict[str, str]]] = {}

    def heard_finished(output: Any) -> None:
        for request_id in output.finished_recving or ():  # vLLM's id: ours, "-", a suffix
            kv_ready_at.setdefault(request_id.split("-")[0], time.perf_counter())
            if os.environ.get("KVBRIDGE_TEST_KV_BLOCKS") and request_id in scheduler.requests:
                block_ids = scheduler.kv_cache_manager.get_block_ids(request_id)
                loaded_states[request_id.split("-")[0]] = core.model_executor.collective_rpc(
                    _hash_states, args=([list(ids) for ids in block_ids],)
                )
        hear_finished(output)

    scheduler._update_from_kv_xfer_finished = heard_finished
    # Each request's KV rows as it ends (before vLLM frees or trims its blocks), on every rank.
    kv_blocks: dict[str, list[dict[str, dict[str, dict[str, str]]]]] = {}
    if os.environ.get("KVBRIDGE_TEST_KV_BLOCKS"):
        free_request = scheduler._free_request

        def free_and_hash(request: Any, *args: Any, **kwargs: Any) -> Any:
            block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            kv_blocks[request.request_id.split("-")[0]] = core.model_executor.collective_rpc(
                _hash_blocks, args=([list(ids) for ids in block_ids], request.num_prompt_tokens)
            )
            return free_request(request, *args, **kwargs)

        scheduler._free_request = free_and_hash

    def add(command: dict[str, Any]) -> list[str]:
        ids = []
        prompts = command["prompts"]
        params = command.get("params") or [None] * len(prompts)
        limits = command.get("max_tokens", 8)
        limits = limits if isinstance(limits, list) else [limits] * len(prompts)
        for prompt, kv_params, limit in zip(prompts, params, limits, strict=True):
            request_id = uuid.uuid4().hex
            if kv_params and kv_params.get("transfer_mode") == "push":
                # NixlPushConnector pairs decode's request with prefill's by their external
                # id (a PD proxy sends both the same X-Request-Id): prefill's, its suffix off.
                request_id = str(kv_params["remote_request_id"]).rsplit("-", 1)[0]
            extra = {"kv_transfer_params": kv_params} if kv_params is not None else None
            sampling = SamplingParams(
                temperature=0,
                max_tokens=limit,
                detokenize=False,
                extra_args=extra,
                output_kind=RequestOutputKind.CUMULATIVE,
            )
            added_at[request_id] = time.perf_counter()
            engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
            ids.append(request_id)
        return ids

    step_times: list[float] = []

    def step() -> None:
        began = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - began)
        for output in outputs:
            if output.outputs and output.outputs[0].token_ids:
                first_token_at.setdefault(output.request_id, time.perf_counter())
            if output.finished:
                finished[output.request_id] = output

    def collect(ids: list[str]) -> list[dict[str, Any]]:
        while not all(request_id in finished for request_id in ids):
            step()
        outputs = []
        for request_id in ids:
            output = finished.pop(request_id)
            completion = output.outputs[0] if output.outputs else None
            first = first_token_at.pop(request_id, None)
            ready = kv_ready_at.pop(request_id, None)
            added = added_at.pop(request_id)
            ranks = kv_blocks.pop(request_id, None) or []
            outputs.append(
                {
                    "tokens": list(completion.token_ids) if completion else [],
                    "finish_reason": completion.finish_reason if completion else None,
                    "kv_transfer_params": output.kv_transfer_params,
                    "ttft_s": first - added if first is not None else None,
                    "kv_ready_s": ready - added if ready is not None else None,
                    "kv_blocks": ranks[0]["blocks"] if ranks else None,
                    "kv_blocks_by_rank": [rank["blocks"] for rank in ranks],
                    "kv_heads_by_rank": [rank["heads"] for rank in ranks],
                    # decode: as loaded; prefill: as it ended
                    "kv_states_by_rank": loaded_states.pop(request_id, None)
                    or [rank["states"] for rank in ranks],
                }
            )
        return outputs

    def offline(command: dict[str, Any]) -> list[dict[str, Any]]:
        """vLLM's offline API itself: it steps only while outputs are due."""
        prompts = command["prompts"]
        params = command.get("params") or [None] * len(prompts)
        sampling = [
            SamplingParams(
                temperature=0,
                max_tokens=command.get("max_tokens", 8),
                detokenize=False,
                extra_args={"kv_transfer_params": kv_params} if kv_params is not None else None,
            )
            for kv_params in params
        ]
        answers = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        return [
            {"tokens": list(answer.outputs[0].token_ids), "params": answer.kv_transfer_params}
            for answer in answers
        ]

    reply({"ready": True, "startup_s": time.perf_counter() - started, "pid": os.getpid()})
    # After an "offline" command the engine is left alone, as an application's own loop
    # leaves it, until a command that steps it.
    background = {"stepping": True}
    for line in _commands(lambda: background["stepping"] and scheduler.has_requests(), step):
        command = json.loads(line)
        op = command["op"]
        if op in ("offline", "generate", "submit", "collect"):
            background["stepping"] = op != "offline"
        if op == "offline":
            reply({"outputs": offline(command)})
        elif op == "generate":
            began = time.perf_counter()
            step_times.clear()
            outputs = collect(add(command))
            reply(
                {
                    "outputs": outputs,
                    "wall_s": time.perf_counter() - began,
                    "steps_ms": [round(1000 * t, 1) for t in step_times],
                }
            )
        elif op == "submit":
            submitted = add(command)
            reply({"submitted": len(submitted)})
        elif op == "abort":
            chosen = command.get("indices")
            picked = [submitted[i] for i in chosen] if chosen is not None else submitted
            running = [request_id for request_id in picked if request_id not in finished]
            engine.abort_request(running)
            reply({"aborted": len(running)})
        elif op == "collect":  # an aborted request gives no output: leave it out
            chosen = command.get("indices")
            outputs = collect([submitted[i] for i in chosen] if chosen is not None else submitted)
            reply({"outputs": outputs})
        elif op == "stats":
            reply(_stats(scheduler, core.model_executor))
        elif op == "reset_prefix_cache":
            reply({"reset": llm.reset_prefix_cache()})
        elif op == "quit":
            reply({"bye": True})
            break
        else:
            reply({"error": f"unknown op {op!r}"})
    llm.llm_engine.engine_core.shutdown()


def _commands(busy: Any, step: Any) -> Any:
    """stdin's lines; while none is waiting and the scheduler has work, step the engine."""
    buffered = ""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.0 if busy() else 0.05)
        if not ready:
            if busy():
                step()
            continue
        chunk = os.read(sys.stdin.fileno(), 65536).decode()
        if not chunk:
            return
        buffered += chunk
        while "\n" in buffered:
            line, buffered = buffered.split("\n", 1)
            if line.strip():
                yield line


def _hash_blocks(
    worker: Any, block_ids: list[list[int]], num_prompt_tokens: int
) -> dict[str, dict[str, dict[str, str]]]:
    """Run on each rank (vLLM's collective_rpc). "blocks": per KV cache group, block position
    → a hash of that block's bytes in every attention layer of the group on this rank
    (whatever its block id); "heads": per group, "position/head" → the same for one KV head,
    the head numbered model-wide (this rank's first head + its index here; MLA's latent is
    head 0 on every rank), so that ranks of different TP sizes compare. For the blocks the
    prompt fills before its last token (decode computes that one again and writes its output
    after it; vLLM's CPU attention packs a block's tokens together, so a partly written block
    is not compared). Blocks the group no longer holds (out of a sliding window) are left
    out; a recurrent state is not hashed."""

    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    groups = runner.kv_cache_config.kv_cache_groups
    replicated = runner.model_config.use_mla
    hashes: dict[str, dict[str, dict[str, str]]] = {"blocks": {}, "heads": {}}
    for index, (group, ids) in enumerate(zip(groups, block_ids, strict=True)):
        caches = [context[name].kv_cache for name in group.layer_names]
        caches = [c for c in caches if isinstance(c, torch.Tensor) and c.dim() in (3, 4)]
        if not caches:
            continue
        block_size = group.kv_cache_spec.block_size
        per_block = block_size // caches[0].shape[-2]  # an attention kernel's smaller blocks
        heads = caches[0].shape[1] if caches[0].dim() == 4 else 1
        first_head = 0 if replicated else get_tensor_model_parallel_rank() * heads
        whole = (num_prompt_tokens - 1) // block_size
        blocks, by_head = {}, {}
        for position, block in enumerate(ids[:whole]):
            if block == 0:
                continue
            pages = [cache[block * per_block : (block + 1) * per_block] for cache in caches]
            blocks[str(position)] = _digest(pages)
            if heads > 1:
                for head in range(heads):
                    by_head[f"{position}/{first_head + head}"] = _digest(
                        [page[:, head] for page in pages]
                    )
        hashes["blocks"][str(index)] = blocks
        hashes["heads"][str(index)] = by_head
    hashes["states"] = _hash_states(worker, block_ids)
    return hashes


def _hash_states(worker: Any, block_ids: list[list[int]]) -> dict[str, str]:
    """Run on each rank: "group/position/layer/part/unit" → a hash of one unit of a Mamba-2
    layer's state block, as vLLM's own mixer views it (`kv_cache`: conv state, SSM state):
    the conv state's x by head, B and C by group, the SSM state by head, numbered model-wide
    (a replicated group has its number on every rank) so that ranks of different TP sizes
    compare."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    digests = {}
    for index, (group, ids) in enumerate(
        zip(runner.kv_cache_config.kv_cache_groups, block_ids, strict=True)
    ):
        for name in group.layer_names:
            state = context[name].kv_cache
            if not isinstance(state, tuple) or len(state) != 2:
                continue  # not a Mamba-2 layer
            conv, ssm = state
            n_groups = runner.model_config.hf_text_config.mamba_n_groups  # Granite-4-hybrid's
            heads, head_dim, size = ssm.shape[1:]
            dim_first = is_conv_state_dim_first()
            channels_here = conv.shape[1 if dim_first else 2]
            groups = (channels_here - heads * head_dim) // (2 * size)
            first_group = rank * groups if n_groups >= tp else rank * n_groups // tp
            for position, block in enumerate(ids):
                if block == 0:
                    continue
                channels = conv[block] if dim_first else conv[block].T
                prefix = f"{index}/{position}/{name}"
                for head in range(heads):
                    unit = rank * heads + head
                    rows = channels[head * head_dim : (head + 1) * head_dim]
                    digests[f"{prefix}/x/{unit}"] = _digest([rows])
                    digests[f"{prefix}/ssm/{unit}"] = _digest([ssm[block, head]])
                for part, start in (
                    ("B", heads * head_dim),
                    ("C", heads * head_dim + groups * size),
                ):
                    for local in range(groups):
                        rows = channels[start + local * size : start + (local + 1) * size]
                        digests[f"{prefix}/{part}/{first_group + local}"] = _digest([rows])
    return digests


def _digest(tensors: list[Any]) -> str:
    import hashlib

    import torch

    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _stats(scheduler: Any, executor: Any) -> dict[str, Any]:
    stats: dict[str, Any] = {
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
    }
    ranks = [counted for counted in executor.collective_rpc(_counters) if counted is not None]
    if ranks:  # kvbridge's: summed over the TP ranks' workers
        stats["connector"] = {key: sum(rank[key] for rank in ranks) for key in ranks[0]}
    return stats


def _counters(worker: Any) -> dict[str, Any] | None:
    """Run on each rank (vLLM's collective_rpc): kvbridge's transfer counters of its worker
    (None: another connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvbridge.integrations.vllm import KVBridgeConnector

    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    if not isinstance(connector, KVBridgeConnector):
        return None
    return dataclasses.asdict(connector.counters())


if __name__ == "__main__":
    sys.exit(main())
