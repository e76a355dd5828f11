"""Decode first in the vLLM connector's scheduler side, without vLLM: the parameters a proxy
sends each side, the group that streams, the blocks each prefill step completes (and, for a
hybrid, the state block for after the forward), the send that takes a streamed room over, and
decode's load planned before prefill answered. The worker's side: test_vllm_stream_writes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.integrations.vllm_blocks import Group, GroupKind, blocks_to_stream
from kvbridge.integrations.vllm_load_plan import SchedulerConfig
from kvbridge.integrations.vllm_requests import (
    RemotePrefill,
    decode_first_request,
    stream_prefill_request,
)
from kvbridge.integrations.vllm_scheduler import SchedulerSide
from kvbridge.integrations.vllm_steps import RestRun, SendSpec, StreamAbort, StreamSpec

FULL = (Group(GroupKind.FULL, 4),)
MAMBA = (Group(GroupKind.STATE, 64), Group(GroupKind.FULL, 4))  # state first, as vLLM orders it
SLIDING = Group(GroupKind.SLIDING, 4)
URL = "http://10.0.0.1:8998"


def request(tokens: int, params: dict[str, Any], request_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=tokens,
        prompt_token_ids=list(range(tokens)),
        _all_token_ids=list(range(tokens)),
        num_computed_tokens=0,
        status=SimpleNamespace(name="RUNNING"),
    )


@pytest.mark.parametrize(
    ("sent", "computed", "final", "blocks", "now_sent"),
    [
        (0, 7, False, (10, 11), 1),  # a block filled in part waits
        (1, 10, False, (11, 12), 2),
        (2, 10, True, (12,), 3),  # the prompt's last, partial block goes with the end
        (3, 10, True, (), 3),
    ],
)
def test_a_step_streams_the_blocks_it_completes(
    sent: int, computed: int, final: bool, blocks: tuple[int, ...], now_sent: int
) -> None:
    ids = [10, 11, 12]
    assert blocks_to_stream(ids, sent, computed, final, 4) == (blocks[: now_sent - sent], now_sent)


def test_prefill_streams_each_step_and_its_send_takes_the_room_over() -> None:
    handed: list[SendSpec] = []
    prefill = SchedulerSide(SchedulerConfig("p", True, FULL), lambda s: handed.append(s) or None)
    prefill.bootstrap_urls[0] = URL
    params = stream_prefill_request({"prompt": [1]}, 77)["kv_transfer_params"]
    ask = request(10, params)
    prefill.on_new_request(ask)
    assert prefill.streams.active
    ids = ([20, 21, 22],)
    prefill.stream_step({"r": 6}, lambda request_id: ids)  # a chunk of 6 tokens
    ask.num_computed_tokens = 6
    prefill.stream_step({"r": 4}, lambda request_id: ids)  # the rest
    first, second = prefill.take_step(idle=False).streams
    assert first == StreamSpec("r", 77, (20,), False)
    assert second == StreamSpec("r", 77, (21, 22), True)
    prefill.stream_step({"r": 1}, lambda request_id: ids)  # its output token: nothing more
    assert prefill.take_step(idle=False).streams == []
    ask.status.name, ask.num_computed_tokens = "FINISHED_LENGTH_CAPPED", 10
    keep, answer = prefill.finished(ask, ids)
    assert keep
    assert answer is not None
    (send,) = handed
    assert (send.room, send.streamed, send.aborted) == (77, True, "")  # the proxy's room


def test_a_streamed_request_that_ends_early_keeps_its_blocks_until_no_write_reads_them() -> None:
    handed: list[SendSpec] = []
    prefill = SchedulerSide(SchedulerConfig("p", True, FULL), lambda s: handed.append(s) or None)
    ask = request(10, stream_prefill_request({}, 5)["kv_transfer_params"])
    prefill.on_new_request(ask)
    prefill.stream_step({"r": 8}, lambda request_id: ([1, 2, 3],))
    ask.status.name = "FINISHED_ABORTED"
    assert prefill.finished(ask, ([1, 2, 3],)) == (True, None)
    (send,) = handed
    assert send.streamed
    assert "FINISHED_ABORTED" in send.aborted
    assert prefill.pending
    # One ended before any block was complete: its room may be open all the same (decode
    # waiting on it): the worker fails it, and frees the blocks once nothing is out.
    quiet = request(10, stream_prefill_request({}, 6)["kv_transfer_params"], "q")
    prefill.on_new_request(quiet)
    prefill.stream_step({"q": 2}, lambda request_id: ([4],))
    quiet.status.name = "FINISHED_ABORTED"
    assert prefill.finished(quiet, ([4],)) == (True, None)
    assert (handed[-1].room, handed[-1].streamed) == (6, True)
    # A request for no stream frees its blocks at once.
    plain = request(10, {"do_remote_decode": True}, "p")
    plain.status.name = "FINISHED_ABORTED"
    assert prefill.finished(plain, ([5],)) == (False, None)


def test_decode_plans_a_decode_first_load_as_if_prefill_had_answered() -> None:
    params = decode_first_request({}, URL, 77)["kv_transfer_params"]
    remote = RemotePrefill.from_params(params)
    assert remote is not None
    assert (remote.decode_first, remote.room) == (True, 77)
    decode = SchedulerSide(SchedulerConfig("d", False, FULL))
    ask = request(10, params)
    assert decode.matched_tokens(ask, 4) == (6, True)  # a local prefix of 4 tokens
    decode.after_alloc(ask, ([30, 31, 32],), 6)
    (load,) = decode.take_step(idle=False).loads
    assert load.error is None
    assert (load.remote.num_tokens, load.remote.blocks, load.remote.block_sizes) == (
        10,
        ((0, 3),),
        (4,),
    )
    # A hybrid's groups are planned from position 0 as well: the state group's one block,
    # and with a recurrent state prefill stops a token short (decode computes it).
    hybrid = SchedulerSide(SchedulerConfig("d", False, (*FULL, Group(GroupKind.STATE, 64))))
    other = request(10, decode_first_request({}, URL, 77)["kv_transfer_params"])
    assert hybrid.matched_tokens(other, 0) == (9, True)
    hybrid.after_alloc(other, ([30, 31, 32], [7]), 9)
    (load,) = hybrid.take_step(idle=False).loads
    assert load.error is None
    assert (load.remote.num_tokens, load.remote.blocks, load.remote.block_sizes) == (
        9,
        ((0, 3), (0, 1)),
        (4, 64),
    )
    assert (load.blocks, load.skips) == (((30, 31, 32), (7,)), (0, 0))


def test_a_sliding_window_hybrid_is_sent_decode_first_from_position_0() -> None:
    """Prefill of a sliding-window hybrid sends a decode-first request into the proxy's
    room with every group laid out from position 0, its window's dropped blocks marked null
    at their positions (a worker that does not stream writes it whole after the forward);
    decode's load of the same request pairs each block it needs by position."""
    groups = (Group(GroupKind.FULL, 4), Group(GroupKind.SLIDING, 4))
    handed: list[SendSpec] = []
    prefill = SchedulerSide(SchedulerConfig("p", True, groups), lambda s: handed.append(s) or None)
    prefill.bootstrap_urls[0] = URL
    ask = request(10, stream_prefill_request({}, 77)["kv_transfer_params"])
    prefill.on_new_request(ask)
    ask.status.name, ask.num_computed_tokens = "FINISHED_LENGTH_CAPPED", 10
    keep, _ = prefill.finished(ask, ([20, 21, 22], [0, 31, 32]))
    assert keep
    (send,) = handed
    assert (send.room, send.blocks, send.streamed) == (77, ((20, 21, 22), (0, 31, 32)), True)
    decode = SchedulerSide(SchedulerConfig("d", False, groups))
    load_ask = request(10, decode_first_request({}, URL, 77)["kv_transfer_params"])
    assert decode.matched_tokens(load_ask, 0) == (10, True)
    decode.after_alloc(load_ask, ([40, 41, 42], [0, 0, 52]), 10)  # its window: the last block
    (load,) = decode.take_step(idle=False).loads
    assert (load.blocks, load.skips) == (((40, 41, 42), (52,)), (0, 2))
    # A group holding fewer blocks than decode lays out would shift the groups after it:
    # not sent, and the proxy's room fails at once (decode is waiting on it).
    prefill.on_new_request(
        short := request(10, stream_prefill_request({}, 78)["kv_transfer_params"], "s")
    )
    short.status.name, short.num_computed_tokens = "FINISHED_LENGTH_CAPPED", 10
    assert prefill.finished(short, ([20, 21, 22], [0, 31])) == (True, None)
    assert (handed[-1].room, handed[-1].streamed) == (78, True)
    assert "holds 2 block(s) of 10 tokens, decode first lays out 3" in handed[-1].aborted
    # So does one that ends before it is sent (here: aborted in prefill's queue).
    prefill.on_new_request(
        gone := request(10, stream_prefill_request({}, 79)["kv_transfer_params"], "g")
    )
    gone.status.name = "FINISHED_ABORTED"
    assert prefill.finished(gone, ([], [])) == (True, None)
    assert handed[-1].room == 79
    assert "ended FINISHED_ABORTED" in handed[-1].aborted


def test_a_preempted_streamed_request_fails_its_room_and_streams_no_more() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, FULL), lambda send: None)
    ask = request(10, stream_prefill_request({}, 8)["kv_transfer_params"])
    prefill.on_new_request(ask)
    prefill.stream_step({"r": 4}, lambda request_id: ([1, 2, 3],))
    prefill.stream_step({}, lambda request_id: ([1, 2, 3],), preempted={"r", "other"})
    ask.num_computed_tokens = 0  # computed again from the start, into new blocks
    prefill.stream_step({"r": 10}, lambda request_id: ([5, 6, 7],))
    step = prefill.take_step(idle=False)
    assert step.stream_aborts == {"r": StreamAbort(8, "vLLM preempted the prefill request")}
    assert [spec.blocks for spec in step.streams] == [(1,)]


@pytest.mark.parametrize(
    ("groups", "stages", "streamed"),
    [
        (FULL, 1, 0),
        (MAMBA, 1, 1),
        ((*MAMBA, Group(GroupKind.STATE, 64)), 1, 1),
        ((SLIDING, SLIDING, *FULL), 1, 2),  # the windows go after the forward
        ((*FULL, *FULL), 1, 0),  # the second group after the forward
        ((SLIDING,), 1, None),  # no full attention
        (FULL, 2, None),  # pipeline stages
    ],
)
def test_the_group_that_streams_is_the_first_full_attention_group(
    groups: tuple[Group, ...], stages: int, streamed: int | None
) -> None:
    config = SchedulerConfig("p", True, groups, pipeline_stages=stages)
    assert config.stream_group == streamed
    assert config.streams is (streamed is not None)


def test_a_hybrid_streams_its_attention_blocks_and_names_its_state_block_at_the_end() -> None:
    """Mamba-2 beside full attention: the attention group streams block by block as its own
    block size says; the final step names the state block, for the room's last chunk once
    the forward wrote it."""
    prefill = SchedulerSide(SchedulerConfig("p", True, MAMBA), lambda send: None)
    ask = request(10, stream_prefill_request({}, 7)["kv_transfer_params"])
    prefill.on_new_request(ask)  # cut one short (decode computes the last token): 9 tokens
    ids = ([9], [20, 21, 22])
    prefill.stream_step({"r": 6}, lambda request_id: ids)
    ask.num_computed_tokens = 6
    prefill.stream_step({"r": 3}, lambda request_id: ids)
    first, second = prefill.take_step(idle=False).streams
    assert first == StreamSpec("r", 7, (20,), False)
    assert second == StreamSpec("r", 7, (21, 22), True, (RestRun(None, ((9,), ())),))
    # A block table that is not what decode planned: the room fails, nothing streams.
    short = request(10, stream_prefill_request({}, 8)["kv_transfer_params"], "s")
    prefill.on_new_request(short)
    prefill.stream_step({"s": 9}, lambda request_id: ([9], [30]))  # 1 block for 9 tokens
    step = prefill.take_step(idle=False)
    assert step.streams == []
    assert step.stream_aborts["s"].room == 8
    assert "not what decode planned" in step.stream_aborts["s"].reason


def test_a_sliding_window_hybrid_streams_its_full_attention_group_at_its_place() -> None:
    """Gemma-3-shaped, windows first: the full-attention group streams from its place
    after the windows' blocks (decode lays every group out from position 0); at the end the
    windows (their dropped blocks null) go from position 0, and a group after the streamed
    one from its own place."""
    groups = (SLIDING, SLIDING, *FULL, SLIDING)
    prefill = SchedulerSide(SchedulerConfig("p", True, groups), lambda send: None)
    ask = request(10, stream_prefill_request({}, 7)["kv_transfer_params"])
    prefill.on_new_request(ask)
    ids = ([0, 11, 12], [0, 21, 22], [30, 31, 32], [0, 41, 42])
    prefill.stream_step({"r": 6}, lambda request_id: ids)
    ask.num_computed_tokens = 6
    prefill.stream_step({"r": 4}, lambda request_id: ids)
    first, second = prefill.take_step(idle=False).streams
    assert first == StreamSpec("r", 7, (30,), False, position=6)  # 3 blocks per group before
    assert second == StreamSpec(
        "r",
        7,
        (31, 32),
        True,
        (
            RestRun(0, ((0, 11, 12), (0, 21, 22), (), ())),
            RestRun(9, ((), (), (), (0, 41, 42))),
        ),
        position=7,
    )
