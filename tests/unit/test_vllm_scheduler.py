"""The vLLM connector's scheduler side with vLLM's request objects stood in for: what a
recurrent state asks of prefill and decode, and what a load that cannot be right does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvbridge.integrations.vllm_blocks import Group, GroupKind
from kvbridge.integrations.vllm_load_plan import SchedulerConfig
from kvbridge.integrations.vllm_requests import decode_first_request
from kvbridge.integrations.vllm_scheduler import SchedulerSide
from kvbridge.integrations.vllm_steps import SendSpec

PARAMS = "kv_transfer_params"
HYBRID = (Group(GroupKind.STATE, 64), Group(GroupKind.FULL, 4))


def request(tokens: int, params: dict[str, Any], request_id: str = "r") -> SimpleNamespace:
    prompt = list(range(1, tokens + 1))
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=tokens,
        prompt_token_ids=prompt,
        _all_token_ids=list(prompt),
        max_tokens=8,
        num_computed_tokens=tokens,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )


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


def test_prefill_hands_a_finished_request_to_its_workers_at_once_or_frees_it() -> None:
    handed: list[SendSpec] = []

    def hand_off(send: SendSpec) -> str | None:
        handed.append(send)
        return None

    prefill = SchedulerSide(SchedulerConfig("p", True, HYBRID[1:]), hand_off)
    prefill.bootstrap_urls[0] = "http://127.0.0.1:9"
    keep, params = prefill.finished(request(100, {"do_remote_decode": True}), ([4, 5, 6],))
    assert keep
    assert params is not None
    assert prefill.pending
    (send,) = handed  # no engine step in between
    assert (send.room, send.blocks) == (params["kvbridge_room"], ((4, 5, 6),))
    # Workers that cannot take it: vLLM frees the blocks, decode gets no parameters.
    stuck = SchedulerSide(SchedulerConfig("p", True, HYBRID[1:]), lambda send: "worker gone")
    stuck.bootstrap_urls[0] = "http://127.0.0.1:9"
    assert stuck.finished(request(100, {"do_remote_decode": True}), ([4],)) == (False, None)
    assert not stuck.pending


def test_decode_refuses_a_state_prefill_did_not_stop_short_of_and_frees_its_blocks() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, HYBRID), lambda send: None)
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


def test_decode_renews_the_lease_of_a_waiting_request_every_third_of_it() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, HYBRID[1:], lease_s=3.0), lambda s: None)
    prefill.bootstrap_urls[0] = "http://127.0.0.1:9"
    _, params = prefill.finished(request(100, {"do_remote_decode": True}), ([4, 5, 6],))
    assert params is not None
    assert params["kvbridge_lease_s"] == 3.0
    decode = SchedulerSide(SchedulerConfig("d", False, HYBRID[1:]))
    waiting = request(100, params, "d1")
    decode.on_new_request(waiting, now=10.0)
    renewed = [bool(decode.take_step(False, now=t).renewals) for t in (10.5, 11.0, 11.5, 12.1)]
    assert renewed == [False, True, False, True]
    assert decode.matched_tokens(waiting, 0) == (100, True)
    decode.after_alloc(waiting, ([1, 2, 3, 4],), 100)  # it asks now: no lease to renew
    assert not decode.take_step(False, now=20.0).renewals
    # Decode first: the load goes out before prefill's scheduler reached the request, and
    # decode renews the room until the load ends.
    first = request(100, decode_first_request({}, "http://127.0.0.1:9", 77)[PARAMS], "d3")
    decode.on_new_request(first, now=30.0)
    assert decode.matched_tokens(first, 0)[1]
    decode.after_alloc(first, (list(range(25)),), 100)
    step = decode.take_step(False, now=30.0)
    assert step.loads
    assert not step.renewals
    (renewed,) = decode.take_step(False, now=31.0).renewals  # every second
    assert renewed.decode_first
    decode.on_output(set(), {"d3"})  # loaded: nothing more to renew
    assert not decode.take_step(False, now=60.0).renewals
    # A prefill without leases (0, or a release before them): nothing to renew.
    old = request(100, {**params, "kvbridge_lease_s": 0}, "d2")
    decode.on_new_request(old, now=0.0)
    assert not decode.take_step(False, now=100.0).renewals
