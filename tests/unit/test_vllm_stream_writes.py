"""Decode first in the vLLM connector's worker, without vLLM: each layer of a step handed over
behind its gate before the forward and written as the forward saves it, the whole request when
decode asks late, a recurrent state after the forward, and rooms that fail (a forward that
never ended, a preempted request)."""

from __future__ import annotations

from typing import Any

from kvbridge.integrations.vllm_cache import VLLMCache
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.integrations.vllm_steps import RestRun, StreamAbort, StreamSpec
from kvbridge.integrations.vllm_streams import (
    Streams,
    joined_runs,
    layer_ranges,
    stream_positions,
)
from kvbridge.wire.messages import KVPoll
from kvbridge.write_gate import WriteGate


class FakeSender:
    def __init__(self, room: int) -> None:
        self.room = room
        self.asked = False
        self.sent: list[tuple[list[int], range | None, bool]] = []
        self.gates: list[WriteGate | None] = []  # each send's
        self.slots: list[list[int]] = []  # each send's state slots
        self.positions: list[int | None] = []  # each send's place among the room's pages
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
        state_indices: Any = (),
        position: int | None = None,
    ) -> None:
        self.sent.append((list(pages), layers, last))
        self.gates.append(gate)
        self.slots.append(list(state_indices))
        self.positions.append(position)

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


def streams(
    layers: int = 3, state_slots: bool = False, names: dict[str, int] | None = None
) -> tuple[Streams, FakePrefill]:
    """`names`: every attention layer's position (default: one per buffer, all streamed);
    given, the streamed ones are those whose name ends in "full"."""
    import numpy as np

    from kvbridge.cache import KVArgs
    from kvbridge.wire import KVLayout

    kv = [np.zeros((8, 4, 1, 8), np.uint16) for _ in range(2 * layers)]
    args = KVArgs.from_numpy(kv, kv_layout=KVLayout.MHA, total_kv_heads=1)
    positions = names or {f"model.layers.{i}.attn": i for i in range(layers)}
    streamed = {name for name in positions if names is None or name.endswith("full")}
    prefill = FakePrefill()
    cache = VLLMCache(args, 2, layer_positions=positions, state_slots=state_slots)
    state_groups = frozenset({0}) if state_slots else frozenset()
    worker = Streams(
        prefill,  # type: ignore[arg-type]
        cache,
        ConnectorCounters(),
        stream_positions(positions, streamed),
        state_groups,
    )
    return worker, prefill


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


def test_an_aborted_stream_drops_its_held_layers_and_streams_no_more() -> None:
    worker, fake = streams()
    fake.sender(8).asked = True
    worker.begin([StreamSpec("r", 8, (1,), False)])  # its layers handed over, gated
    assert len(fake.senders[8].sent) == 3
    worker.abort("r", StreamAbort(8, "preempted"))  # its held writes are dropped unwritten
    worker.layer_saved("model.layers.0.attn")
    worker.end()
    worker.begin([StreamSpec("r", 8, (2,), False)])
    assert (len(fake.senders[8].sent), fake.senders[8].aborted) == (3, "preempted")


def test_a_room_that_fails_before_anything_of_it_streamed_fails_at_once() -> None:
    """The request's first step failed (its blocks are not what decode planned, or vLLM
    preempted it before its forward): the worker has no stream of it yet, and opens the room
    to fail it, rather than leave decode waiting until the request ends."""
    worker, fake = streams()
    worker.abort("r", StreamAbort(9, "its blocks are not what decode planned"))
    assert fake.senders[9].aborted == "its blocks are not what decode planned"
    worker.begin([StreamSpec("r", 9, (1,), True)])  # nothing more goes into it
    worker.layer_saved("model.layers.2.attn")
    worker.end()
    assert fake.senders[9].sent == []
    stream = worker.take("r")  # the request's end finds it failed
    assert stream is not None
    assert stream.done
    # An abort that comes after the request's send took its stream opens nothing again.
    fake.senders.clear()
    worker.abort("r", StreamAbort(9, "late"))
    assert fake.senders == {}
    assert worker.take("r") is None


def test_a_hybrids_state_goes_as_the_rooms_last_chunk_after_the_forward() -> None:
    """A Mamba-2 hybrid: its attention layers go during the forward, none of them the room's
    last; the state block is the last chunk, handed over before the forward behind a gate
    that opens only after it (the state is written after the last attention layer)."""
    worker, fake = streams(state_slots=True)
    fake.sender(7).asked = True
    worker.begin([StreamSpec("r", 7, (1,), True, (RestRun(None, ((9,), ())),))])
    sender = fake.senders[7]
    assert [last for _, _, last in sender.sent] == [False, False, False, True]
    assert (sender.sent[-1], sender.slots[-1]) == (([], None, True), [9])
    for layer in range(3):
        worker.layer_saved(f"model.layers.{layer}.attn")
    assert sender.opened() == [True, True, True, False]
    worker.end()
    assert sender.opened() == [True] * 4
    assert len(sender.sent) == 4
    stream = worker.take("r")
    assert stream is not None
    assert (stream.done, stream.layer_writes) == (True, 3)
    # Decode asks only after the forward: the pages and the state in one last chunk.
    worker.begin([StreamSpec("q", 8, (2,), True, (RestRun(None, ((5,), ())),))])
    worker.end()
    assert fake.senders[8].sent == [([4, 5], None, True)]
    assert fake.senders[8].slots == [[5]]


def test_a_hybrids_room_fails_when_its_final_forward_never_ended_after_its_last_layer() -> None:
    """Every attention layer saved, then no `end`: the state after the last attention layer
    is not known to be written, so the room fails rather than send it."""
    worker, fake = streams(state_slots=True)
    fake.sender(7).asked = True
    worker.begin([StreamSpec("r", 7, (1,), True, (RestRun(None, ((9,), ())),))])
    for layer in range(3):
        worker.layer_saved(f"model.layers.{layer}.attn")
    worker.begin([])  # no end() in between
    worker.end()
    sender = fake.senders[7]
    assert sender.aborted is not None
    assert "never ended" in sender.aborted
    assert sender.opened()[-1] is False  # the state's write was dropped, never posted


# A sliding-window hybrid's layers: each buffer holds a sliding-window layer and a full one
# (two KV cache groups share it); the full ones stream.
SLIDING_AND_FULL = {
    "model.layers.0.sliding": 0,
    "model.layers.1.full": 0,
    "model.layers.2.sliding": 1,
    "model.layers.3.full": 1,
}


def test_a_sliding_window_hybrid_streams_its_full_layers_at_their_place() -> None:
    """Windows first (2 blocks each, block 0 dropped), then the full group, streamed from
    its place (block 2: page 4): only a full layer's save opens a gate, and the windows go
    after the forward as the room's last chunk, from position 0."""
    worker, fake = streams(layers=2, names=SLIDING_AND_FULL)
    fake.sender(7).asked = True
    windows = RestRun(0, ((0, 6), ()))
    worker.begin([StreamSpec("r", 7, (3, 4), True, (windows, RestRun(4, ((), ()))), 2)])
    sender = fake.senders[7]
    assert sender.sent == [
        ([6, 7, 8, 9], range(0, 1), False),
        ([6, 7, 8, 9], range(1, 2), False),
        ([-1, -1, 12, 13], None, True),  # the windows, once the forward ended
    ]
    assert sender.positions == [4, 4, 0]
    worker.layer_saved("model.layers.0.sliding")  # a window's layer: its KV is not streamed
    assert sender.opened() == [False, False, False]
    worker.layer_saved("model.layers.1.full")
    worker.layer_saved("model.layers.2.sliding")
    assert sender.opened() == [True, False, False]
    worker.layer_saved("model.layers.3.full")
    assert sender.opened() == [True, True, False]
    worker.end()
    assert sender.opened() == [True, True, True]
    # Decode asks only after the forward: every group in one chunk, from position 0.
    worker.begin([StreamSpec("q", 8, (3, 4), True, (windows, RestRun(4, ((), ()))), 2)])
    worker.end()
    late = fake.senders[8]
    assert (late.sent, late.positions) == ([([-1, -1, 12, 13, 6, 7, 8, 9], None, True)], [0])


def test_a_group_after_the_streamed_one_goes_from_its_own_place() -> None:
    worker, fake = streams(layers=2, names=SLIDING_AND_FULL)
    fake.sender(7).asked = True
    spec = StreamSpec("r", 7, (3,), False, position=0)
    worker.begin([spec])
    worker.end()
    worker.begin(
        [StreamSpec("r", 7, (4,), True, (RestRun(0, ((), ())), RestRun(2, ((), (0, 6)))), 1)]
    )
    worker.end()
    sender = fake.senders[7]
    assert [pages for pages, _, _ in sender.sent] == [[6, 7]] * 2 + [[8, 9]] * 2 + [
        [-1, -1, 12, 13]
    ]
    assert sender.positions == [0, 0, 2, 2, 4]
    assert sender.sent[-1][2]  # the room's last chunk


def test_a_forward_that_never_ended_fails_only_the_rooms_that_need_its_end() -> None:
    """Every full layer saved, then no `end`: a room in the middle of its prompt keeps what
    went (its layers were computed); the final one, whose windows wait for the forward's
    end, fails, and so does a final one decode had not asked for (its pages held back)."""
    worker, fake = streams(layers=2, names=SLIDING_AND_FULL)
    for room in (1, 2):
        fake.sender(room).asked = True
    windows = (RestRun(0, ((0, 6), ())), RestRun(4, ((), ())))
    worker.begin(
        [
            StreamSpec("a", 1, (3,), False, position=2),
            StreamSpec("b", 2, (3, 4), True, windows, 2),
            StreamSpec("c", 3, (3, 4), True, windows, 2),  # decode not asked
        ]
    )
    for name in SLIDING_AND_FULL:
        worker.layer_saved(name)
    worker.begin([])  # no end() in between
    worker.end()
    assert [fake.senders[room].aborted is None for room in (1, 2, 3)] == [True, False, False]
    assert fake.senders[3].sent == []  # its held pages never went
    # A layer never saved: every room of the forward fails.
    worker, fake = streams(layers=2, names=SLIDING_AND_FULL)
    fake.sender(1).asked = True
    worker.begin([StreamSpec("a", 1, (3,), False, position=2)])
    worker.layer_saved("model.layers.1.full")
    worker.begin([])
    assert fake.senders[1].aborted is not None


def test_the_streamed_groups_last_layer_ends_the_last_range_and_runs_that_touch_join() -> None:
    # Its layers in buffers 0 and 1 of 3 (another group's layer alone in the last one).
    assert layer_ranges([0, 1], 3) == [range(0, 1), range(1, 3)]
    assert layer_ranges([2], 3) == [range(0, 3)]
    worker, fake = streams(layers=3, names={"model.layers.0.full": 0, "model.layers.2.full": 1})
    fake.sender(1).asked = True
    worker.begin([StreamSpec("a", 1, (3,), False, position=0)])
    sender = fake.senders[1]
    assert [layers for _, layers, _ in sender.sent] == [range(0, 1), range(1, 3)]
    worker.layer_saved("model.layers.2.full")
    assert sender.opened() == [True, True]
    assert joined_runs([(0, [1, 2]), (2, [3]), (9, []), (5, [4])]) == [(0, [1, 2, 3]), (5, [4])]
    assert joined_runs([(None, [1]), (None, [2])]) == [(None, [1, 2])]
