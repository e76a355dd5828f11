"""The vLLM connector's scheduler side with vLLM's request objects stood in for: what a
recurrent state asks of prefill and decode, and what a load that cannot be right does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvbridge.integrations.vllm_blocks import Group, GroupKind
from kvbridge.integrations.vllm_scheduler import SchedulerConfig, SchedulerSide

HYBRID = (Group(GroupKind.STATE, 64), Group(GroupKind.FULL, 4))


def request(tokens: int, params: dict[str, Any], request_id: str = "r") -> SimpleNamespace:
    prompt = list(range(1, tokens + 1))
    return SimpleNamespace(
        request_id=request_id, kv_transfer_params=params, num_prompt_tokens=tokens,
        prompt_token_ids=prompt, _all_token_ids=list(prompt), max_tokens=8,
        num_computed_tokens=tokens, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )  # fmt: skip


def test_prefill_stops_one_token_short_of_a_recurrent_state_once() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, HYBRID))
    ask = request(10, {"do_remote_decode": True})
    prefill.on_new_request(ask)
    prefill.on_new_request(ask)  # rescheduled: not cut again
    assert (ask.num_prompt_tokens, len(ask.prompt_token_ids), ask.max_tokens) == (9, 9, 1)
    # A client's own marker does not skip the cut (nothing in the request decides it).
    other = request(10, {"do_remote_decode": True, "kvbridge_truncated": True}, "s")
    prefill.on_new_request(other)
    assert other.num_prompt_tokens == 9
    attention_only = SchedulerSide(SchedulerConfig("p", True, HYBRID[1:]))
    plain = request(10, {"do_remote_decode": True})
    attention_only.on_new_request(plain)
    assert plain.num_prompt_tokens == 10


def test_decode_refuses_a_state_prefill_did_not_stop_short_of_and_frees_its_blocks() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, HYBRID))
    prefill.bootstrap_urls[0] = "http://127.0.0.1:9"
    done = request(10, {"do_remote_decode": True})  # never cut: computed all 10 tokens
    _, params = prefill.finished(done, ([5], [1, 2, 3]))
    assert params is not None
    decode = SchedulerSide(SchedulerConfig("d", False, HYBRID))
    load = request(10, params, "d1")
    assert decode.matched_tokens(load, 0) == (10, True)
    decode.after_alloc(load, ([7], [11, 12, 13]), 10)
    (spec,) = decode.take_step(idle=False).loads
    assert spec.error is not None
    assert "must stop 1 short" in spec.error
    assert spec.blocks == ((7,), (11, 12, 13))  # reported failed (the worker releases prefill)
