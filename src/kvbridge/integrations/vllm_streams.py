"""Prefill's worker side, decode first: each streamed request's room, written during the
forward. Before a step's forward (`begin`), the blocks the step completes (`StreamSpec`) are
this step's pages of each room, and every layer of them is handed over at once for each room
whose decode ranks have all asked, layer by layer behind one `WriteGate` per layer of the
streamed KV cache group (set up before the forward, so that only the copy is left after it);
as the forward saves each of that group's layers (vLLM's `save_kv_layer`) its gate opens;
after the forward (`end`), every gate of the step is open. A room decode has not asked for
yet keeps its computed pages back and sends them whole once it has, or with the prompt's
end: the whole-request write, done when decode's request comes. The other groups (a
sliding-window hybrid's windows, a Mamba-2 hybrid's state) go after the final forward, as
the room's last chunks, each at its place among the room's pages. When the request ends,
its send takes the room over (`take`). Runs on the engine's thread; no vLLM import."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvbridge.integrations.vllm_cache import RoomContents, VLLMCache
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.integrations.vllm_steps import StreamAbort, StreamSpec
from kvbridge.prefill import KVSender, PrefillManager
from kvbridge.wire.messages import KVPoll
from kvbridge.write_gate import WriteGate

log = logging.getLogger("kvbridge.vllm")

ASKED = (KVPoll.WaitingForInput, KVPoll.Transferring)  # every decode rank sent its request
TAKEN_KEPT = 4096  # requests whose sends took their streams, remembered


# A run of a room's pages: where the first goes among the room's pages (None: after the
# pages before, in order), and the pages.
Piece = tuple[int | None, list[int]]


@dataclass
class Stream:
    """One request's room while its prompt is computed."""

    sender: KVSender
    held: list[int] = field(default_factory=list)  # pages computed, not sent: decode not asked
    held_at: int | None = None  # where the held pages begin among the room's pages
    pages: tuple[int, ...] = ()  # this step's pages, going out layer by layer
    pages_at: int | None = None  # where they begin
    final: bool = False  # this step ends the prompt
    # What goes after the final forward, as the room's last chunks (windows, a state).
    rest: list[tuple[int | None, RoomContents]] = field(default_factory=list)
    done: bool = False  # the room's last chunk went
    layer_writes: int = 0  # chunks sent by layer range (the rest went whole)


def layer_ranges(positions: Sequence[int], layers: int) -> list[range]:
    """The layer ranges a step's pages go out in, one per position of the streamed group's
    layers (ascending) among the `layers` of the buffers: each ends at its layer, and the
    last reaches the end (positions past the group's last layer hold other groups' layers,
    whose bytes in these pages nobody uses)."""
    starts = [0, *(position + 1 for position in positions[:-1])]
    stops = [*(position + 1 for position in positions[:-1]), layers]
    return [range(start, stop) for start, stop in zip(starts, stops, strict=True)]


@dataclass
class ForwardStep:
    """One forward's rooms: every room with blocks in it, the gates of those writing during
    it (one per layer range, then one for what goes after the forward), and the last layer
    range whose layer the forward saved so far."""

    rooms: list[Stream] = field(default_factory=list)
    gates: list[WriteGate] = field(default_factory=list)
    saved: int = -1


def joined_runs(pieces: Sequence[Piece]) -> list[Piece]:
    """The pieces that have pages, each that continues the one before joined to it."""
    joined: list[Piece] = []
    for at, pages in pieces:
        if not pages:
            continue
        if joined:
            before_at, before = joined[-1]
            if at is None or (before_at is not None and at == before_at + len(before)):
                joined[-1] = (before_at, before + pages)
                continue
        joined.append((at, list(pages)))
    return joined


class Streams:
    def __init__(
        self,
        prefill: PrefillManager,
        cache: VLLMCache,
        counters: ConnectorCounters,
        positions: Mapping[str, int],
        state_groups: AbstractSet[int] = frozenset(),
    ) -> None:
        """`positions`: the streamed group's layers, by name, each at its position among the
        buffers' layers (`stream_positions`)."""
        self._prefill = prefill
        self._cache = cache
        self._state_groups = state_groups
        self._counters = counters
        if not positions:
            raise ValueError("none of the streamed group's layers has KV among the buffers")
        self._ranges = layer_ranges(sorted(set(positions.values())), cache.kv_args.num_layers)
        # Each streamed layer's gate: the range that ends at its position.
        ends = [layers.stop - 1 for layers in self._ranges[:-1]]
        self._gate_of = {
            name: ends.index(at) if at in ends else len(ends) for name, at in positions.items()
        }
        self._streams: dict[str, Stream] = {}
        # Requests whose streams their sends took over (the latest ones): an abort that comes
        # after must not open their rooms again.
        self._taken: deque[str] = deque(maxlen=TAKEN_KEPT)
        self._step: ForwardStep | None = None  # the forward under way (no `end` yet)
        self._lock = threading.Lock()  # `take` comes from the send inbox's thread

    def begin(self, specs: list[StreamSpec]) -> None:
        """Before the forward: this step's pages of each streamed request, handed over."""
        self._abandon_step()
        self._step = step = ForwardStep()
        stepping: list[Stream] = []
        for spec in specs:
            stream = self._open(spec.room, spec.request_id)
            if stream is None or stream.done:
                continue
            step.rooms.append(stream)
            stream.final = spec.final
            contents = self._cache.send_contents
            stream.rest = [
                (self._pages_at(run.position), contents(run.blocks, self._state_groups))
                for run in spec.rest
            ]
            pages = list(self._cache.pages_of(spec.blocks))
            at = self._pages_at(spec.position)
            if stream.sender.poll() in ASKED:
                if stream.held:  # computed before decode asked: complete, whole
                    self._send(stream, stream.held, None, False, position=stream.held_at)
                    stream.held = []
                stream.pages, stream.pages_at = tuple(pages), at
                stepping.append(stream)
            else:
                if not stream.held:
                    stream.held_at = at
                stream.held += pages
                stream.pages = ()
        if not stepping:
            return
        # Layer-major: writes go in the order handed over, and the gates open in layer order.
        step.gates = [WriteGate() for _ in self._ranges]
        for index, (layers, gate) in enumerate(zip(self._ranges, step.gates, strict=True)):
            for stream in stepping:
                last = stream.final and index == len(self._ranges) - 1 and not stream.rest
                self._send(stream, list(stream.pages), layers, last, gate, position=stream.pages_at)
        # The other groups, written by the final forward, behind a gate only `end()` opens:
        # set up now, and the room's last write may complete it by its notification.
        finals = [stream for stream in stepping if stream.final and stream.rest]
        if finals:
            step.gates.append(after_forward := WriteGate())
            for stream in finals:
                self._send_rest(stream, after_forward)
        for stream in stepping:
            stream.pages = ()

    def _pages_at(self, block_position: int | None) -> int | None:
        return None if block_position is None else block_position * self._cache.pages_per_block

    def layer_saved(self, name: str) -> None:
        """The forward saved a layer: if it is one of the streamed group's, its writes go,
        with any before it that did not."""
        gate, step = self._gate_of.get(name), self._step
        if gate is None or step is None:
            return  # another group's layer, or one that shares another's KV
        step.saved = max(step.saved, gate)
        for opened in step.gates[: gate + 1]:
            opened.open()

    def end(self) -> None:
        """After the forward: every layer of this step goes, and the other groups of a
        final step's rooms; a room decode has not asked for sends its pages whole with the
        prompt's end (written when decode asks), every group in one chunk."""
        step, self._step = self._step, None
        for gate in step.gates if step is not None else ():
            gate.open()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if not stream.done and stream.final and not stream.pages:
                self._send_rest(stream)

    def _send_rest(self, stream: Stream, gate: WriteGate | None = None) -> None:
        """The room's last chunks: the pages held back (decode asked late) and the other
        groups, each run at its place, joined where they follow one another; the state slots
        with the last."""
        pieces = joined_runs(
            sorted(
                [(stream.held_at, stream.held)]
                + [(at, contents.pages) for at, contents in stream.rest],
                key=lambda piece: piece[0] or 0,
            )
        )
        slots = [slot for _, contents in stream.rest for slot in contents.slots]
        *before, (at, pages) = pieces or [(None, [])]
        for piece_at, piece in before:
            self._send(stream, piece, None, False, gate, position=piece_at)
        self._send(stream, pages, None, True, gate, slots, at)
        stream.held = []

    def _abandon_step(self) -> None:
        """A forward that never ended (no `end`): a room whose pages it was computing fails
        (its writes behind closed gates are dropped, never posted) unless it saved every
        layer of the streamed group — and then still if the room's last chunk needed the
        forward's end (the other groups: every streamed layer saved says nothing of the
        layers after the last one; or pages held back while decode had not asked)."""
        step, self._step = self._step, None
        if step is None:
            return
        computed = step.saved == len(self._ranges) - 1
        for stream in step.rooms:
            if not computed or (stream.final and (bool(stream.rest) or not stream.done)):
                self._abort(stream, "the forward that computed its layers never ended")

    def abort(self, request_id: str, abort: StreamAbort) -> None:
        """The request's room fails; nothing more of it goes out. A request nothing was
        streamed of yet (its first step failed) has its room opened here to fail it: decode
        hears now, not when the request ends."""
        with self._lock:
            if request_id in self._taken:
                return  # its send has the room now
        stream = self._open(abort.room, request_id)
        if stream is not None and not stream.done:
            self._abort(stream, abort.reason)

    def _abort(self, stream: Stream, reason: str) -> None:
        stream.done = True
        try:
            stream.sender.abort(reason)
        except Exception as exc:  # never into vLLM's step
            log.error("room %d: %r", stream.sender.room, exc)

    def take(self, request_id: str) -> Stream | None:
        """The request's stream, handed to its send (None: it was never streamed here)."""
        with self._lock:
            self._taken.append(request_id)
            return self._streams.pop(request_id, None)

    def _open(self, room: int, request_id: str) -> Stream | None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            return stream
        try:
            sender = self._prefill.sender(room)
        except Exception as exc:  # the room ended here already: never into vLLM's step
            log.error("request %s: not streamed: %r", request_id, exc)
            return None
        stream = Stream(sender)
        with self._lock:
            self._streams[request_id] = stream
        return stream

    def _send(
        self,
        stream: Stream,
        pages: list[int],
        layers: range | None,
        last: bool,
        gate: WriteGate | None = None,
        state_indices: Sequence[int] = (),
        position: int | None = None,
    ) -> None:
        """One chunk (or layer range of one); `last`: the room's last; `position`: where its
        pages go among the room's (several groups' pages laid end to end). A send that fails
        fails the room, never the forward."""
        if stream.done:
            return
        try:
            stream.sender.send(
                pages,
                last=last,
                layers=layers,
                gate=gate,
                state_indices=state_indices,
                position=position,
            )
        except Exception as exc:
            log.error("room %d: streaming stopped: %r", stream.sender.room, exc)
            stream.done = True
            try:
                stream.sender.abort(repr(exc))
            except Exception as again:
                log.error("room %d: %r", stream.sender.room, again)
            return
        stream.done = last
        if layers is not None:
            stream.layer_writes += 1
            self._counters.layer_writes += 1


def stream_positions(
    positions: Mapping[str, int], stream_layers: AbstractSet[str]
) -> dict[str, int]:
    """The streamed group's layers, by name, each at its position among the buffers' layers."""
    return {name: at for name, at in positions.items() if name in stream_layers}
