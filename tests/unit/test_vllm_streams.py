"""Decode first in the vLLM connector, without vLLM: the parameters a proxy sends each side,
the blocks each prefill step completes, the send that takes a streamed room over, decode's
load planned before prefill answered, and the worker writing each layer of a step as the
forward saves it (or the whole request when decode asks late)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.integrations.vllm_blocks import Group, GroupKind, blocks_to_stream
from kvbridge.integrations.vllm_cache import VLLMCache
from kvbridge.integrations.vllm_load_plan import SchedulerConfig
from kvbridge.integrations.vllm_requests import (
    RemotePrefill,
    SendSpec,
    StreamSpec,
    decode_first_request,
    stream_prefill_request,
)
from kvbridge.integrations.vllm_scheduler import SchedulerSide
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.integrations.vllm_streams import Streams
from kvbridge.wire.messages import KVPoll
from kvbridge.write_gate import WriteGate

FULL = (Group(GroupKind.FULL, 4),)
URL = "http://10.0.0.1:8998"


def request(tokens: int, params: dict[str, Any], request_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=tokens,
        prompt_token_ids=list(range(tokens)),
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
    """Prefill of a sliding-window hybrid (no layer-wise stream: several groups) sends a
    decode-first request whole after its forward into the proxy's room, its window's
    dropped blocks marked null at their positions; decode's load of the same request pairs
    each block it needs by position."""
    groups = (Group(GroupKind.FULL, 4), Group(GroupKind.SLIDING, 4))
    handed: list[SendSpec] = []
    prefill = SchedulerSide(SchedulerConfig("p", True, groups), lambda s: handed.append(s) or None)
    prefill.bootstrap_urls[0] = URL
    ask = request(10, stream_prefill_request({}, 77)["kv_transfer_params"])
    prefill.on_new_request(ask)
    assert not prefill.streams.active  # several groups: the whole request after the forward
    ask.status.name, ask.num_computed_tokens = "FINISHED_LENGTH_CAPPED", 10
    keep, _ = prefill.finished(ask, ([20, 21, 22], [0, 31, 32]))
    assert keep
    (send,) = handed
    assert (send.room, send.blocks, send.streamed) == (77, ((20, 21, 22), (0, 31, 32)), False)
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
    assert (handed[-1].room, handed[-1].streamed) == (78, False)
    assert "holds 2 block(s) of 10 tokens, decode first lays out 3" in handed[-1].aborted
    # So does one that ends before it is sent (here: aborted in prefill's queue).
    prefill.on_new_request(
        gone := request(10, stream_prefill_request({}, 79)["kv_transfer_params"], "g")
    )
    gone.status.name = "FINISHED_ABORTED"
    assert prefill.finished(gone, ([], [])) == (True, None)
    assert handed[-1].room == 79
    assert "ended FINISHED_ABORTED" in handed[-1].aborted


class FakeSender:
    def __init__(self, room: int) -> None:
        self.room = room
        self.asked = False
        self.sent: list[tuple[list[int], range | None, bool]] = []
        self.gates: list[WriteGate | None] = []  # each send's
        self.aborted: str | None = None

    def poll(self) -> KVPoll:
        return KVPoll.WaitingForInput if self.asked else KVPoll.Bootstrapping

    def send(
        self,
        pages: Any,
        *,
        last: bool = False,
        layers: range | None = None,
        gate: WriteGate | None = None,
    ) -> None:
        self.sent.append((list(pages), layers, last))
        self.gates.append(gate)

    def opened(self) -> list[bool | None]:
        """Per send, whether its gate is open (None: it had none)."""
        return [None if gate is None else gate.is_open for gate in self.gates]

    def abort(self, reason: str) -> None:
        self.aborted = reason


class FakePrefill:
    def __init__(self) -> None:
        self.senders: dict[int, FakeSender] = {}

    def sender(self, room: int) -> FakeSender:
        return self.senders.setdefault(room, FakeSender(room))


def streams(layers: int = 3) -> tuple[Streams, FakePrefill]:
    import numpy as np

    from kvbridge.cache import KVArgs
    from kvbridge.wire import KVLayout

    kv = [np.zeros((8, 4, 1, 8), np.uint16) for _ in range(2 * layers)]
    args = KVArgs.from_numpy(kv, kv_layout=KVLayout.MHA, total_kv_heads=1)
    names = {f"model.layers.{i}.attn": i for i in range(layers)}
    prefill = FakePrefill()
    cache = VLLMCache(args, 2, layer_positions=names)
    return Streams(prefill, cache, ConnectorCounters()), prefill  # type: ignore[arg-type]


def test_each_layer_goes_out_as_the_forward_saves_it_once_decode_asked() -> None:
    """Before the forward every layer of the step is handed over behind its layer's gate;
    saving a layer opens its gate (and any before it)."""
    worker, prefill = streams()
    worker.begin([StreamSpec("r", 9, (1,), False)])  # decode has not asked: held back
    for layer in range(3):
        worker.layer_saved(f"model.layers.{layer}.attn")
    worker.end()
    sender = prefill.senders[9]
    assert sender.sent == []
    sender.asked = True
    worker.begin([StreamSpec("r", 9, (2,), True)])
    assert sender.sent == [
        ([2, 3], None, False),  # the held pages, whole, first
        ([4, 5], range(0, 1), False),
        ([4, 5], range(1, 2), False),
        ([4, 5], range(2, 3), True),
    ]
    assert sender.opened() == [None, False, False, False]
    worker.layer_saved("model.layers.0.attn")
    worker.layer_saved("model.layers.0.attn.shared")  # no position of its own: nothing
    assert sender.opened() == [None, True, False, False]
    worker.layer_saved("model.layers.2.attn")  # layer 1 saved unseen: it goes along
    assert sender.opened() == [None, True, True, True]
    worker.end()
    assert len(sender.sent) == 4
    stream = worker.take("r")
    assert stream is not None
    assert (stream.done, stream.layer_writes) == (True, 3)


def test_a_steps_rooms_are_handed_over_layer_by_layer_behind_one_gate_per_layer() -> None:
    worker, prefill = streams(layers=2)
    for room in (1, 2):
        prefill.sender(room).asked = True
    worker.begin([StreamSpec("a", 1, (0,), True), StreamSpec("b", 2, (1,), True)])
    first, second = prefill.senders[1], prefill.senders[2]
    assert first.gates[0] is second.gates[0]  # one gate for layer 0 of every room
    assert first.gates[1] is second.gates[1]
    assert first.gates[0] is not first.gates[1]
    worker.end()
    assert first.opened() == second.opened() == [True, True]


def test_a_step_whose_forward_never_ended_fails_its_rooms_at_the_next_step() -> None:
    """Its closed gates hold layers that were never computed: the rooms fail (their writes are
    dropped unwritten) rather than the gates opening."""
    worker, prefill = streams()
    prefill.sender(3).asked = True
    worker.begin([StreamSpec("r", 3, (1,), True)])
    worker.layer_saved("model.layers.0.attn")
    worker.begin([])  # no end() in between
    sender = prefill.senders[3]
    assert sender.aborted is not None
    assert "never ended" in sender.aborted
    assert sender.opened() == [True, False, False]


def test_a_room_decode_asks_for_late_gets_the_whole_request_with_the_prompts_end() -> None:
    worker, prefill = streams()
    worker.begin([StreamSpec("r", 4, (1,), False)])
    worker.end()
    worker.begin([StreamSpec("r", 4, (2, 3), True)])
    worker.layer_saved("model.layers.0.attn")
    worker.end()
    assert prefill.senders[4].sent == [([2, 3, 4, 5, 6, 7], None, True)]
    stream = worker.take("r")
    assert stream is not None
    assert (stream.done, stream.layer_writes) == (True, 0)
    assert worker.take("r") is None


def test_a_preempted_streamed_request_fails_its_room_and_streams_no_more() -> None:
    prefill = SchedulerSide(SchedulerConfig("p", True, FULL), lambda send: None)
    ask = request(10, stream_prefill_request({}, 8)["kv_transfer_params"])
    prefill.on_new_request(ask)
    prefill.stream_step({"r": 4}, lambda request_id: ([1, 2, 3],))
    prefill.stream_step({}, lambda request_id: ([1, 2, 3],), preempted={"r", "other"})
    ask.num_computed_tokens = 0  # computed again from the start, into new blocks
    prefill.stream_step({"r": 10}, lambda request_id: ([5, 6, 7],))
    step = prefill.take_step(idle=False)
    assert step.stream_aborts == ["r"]
    assert [spec.blocks for spec in step.streams] == [(1,)]
    worker, fake = streams()
    fake.sender(8).asked = True
    worker.begin([StreamSpec("r", 8, (1,), False)])  # its layers handed over, gated
    assert len(fake.senders[8].sent) == 3
    worker.abort("r", "preempted")  # its held writes are dropped unwritten
    worker.layer_saved("model.layers.0.attn")
    worker.end()
    worker.begin([StreamSpec("r", 8, (2,), False)])
    assert (len(fake.senders[8].sent), fake.senders[8].aborted) == (3, "preempted")
