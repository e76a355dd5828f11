"""Prefill's worker side, decode first: each streamed request's room, written during the
forward. Before a step's forward (`begin`), the blocks the step completes (`StreamSpec`) are
this step's pages of each room, and every layer of them is handed over at once for each room
whose decode ranks have all asked, layer by layer behind one `WriteGate` per layer (set up
before the forward, so that only the copy is left after it); as the forward saves each
attention layer (vLLM's `save_kv_layer`) its gate opens; after the forward (`end`), every
gate of the step is open. A room decode has not asked for yet keeps its
computed pages back and sends them whole once it has, or with the prompt's end: the
whole-request write, done when decode's request comes. A recurrent state beside the streamed
group (a Mamba-2 hybrid's) goes after the final forward, as the room's last chunk. When the
request ends, its send takes the room over (`take`). Runs on the engine's thread; no vLLM
import."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvbridge.integrations.vllm_cache import RoomContents, VLLMCache
from kvbridge.integrations.vllm_requests import StreamSpec
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.prefill import KVSender, PrefillManager
from kvbridge.wire.messages import KVPoll
from kvbridge.write_gate import WriteGate

log = logging.getLogger("kvbridge.vllm")

ASKED = (KVPoll.WaitingForInput, KVPoll.Transferring)  # every decode rank sent its request


@dataclass
class Stream:
    """One request's room while its prompt is computed."""

    sender: KVSender
    held: list[int] = field(default_factory=list)  # pages computed, not sent: decode not asked
    pages: tuple[int, ...] = ()  # this step's pages, going out layer by layer
    final: bool = False  # this step ends the prompt
    # What goes after the final forward, as the room's last chunk (a recurrent state).
    rest: RoomContents = field(default_factory=lambda: RoomContents([], []))
    done: bool = False  # the room's last chunk went
    layer_writes: int = 0  # chunks sent by layer range (the rest went whole)


class Streams:
    def __init__(
        self,
        prefill: PrefillManager,
        cache: VLLMCache,
        counters: ConnectorCounters,
        state_groups: AbstractSet[int] = frozenset(),
    ) -> None:
        self._prefill = prefill
        self._cache = cache
        self._state_groups = state_groups
        self._counters = counters
        self._layers = cache.kv_args.num_layers
        self._streams: dict[str, Stream] = {}
        self._gates: list[WriteGate] = []  # this step's, one per layer position
        self._stepping: list[Stream] = []  # this step's rooms behind them
        self._lock = threading.Lock()  # `take` comes from the send inbox's thread

    def begin(self, specs: list[StreamSpec]) -> None:
        """Before the forward: this step's pages of each streamed request, handed over."""
        self._abandon_step()
        stepping: list[Stream] = []
        for spec in specs:
            stream = self._open(spec)
            if stream is None or stream.done:
                continue
            stream.final = spec.final
            if spec.rest:
                stream.rest = self._cache.send_contents(spec.rest, self._state_groups)
            pages = self._cache.pages_of(spec.blocks)
            if stream.sender.poll() in ASKED:
                if stream.held:  # computed before decode asked: complete, whole
                    self._send(stream, stream.held, None, last=False)
                    stream.held = []
                stream.pages = tuple(pages)
                stepping.append(stream)
            else:
                stream.held += pages
                stream.pages = ()
        if not stepping:
            return
        # Layer-major: writes go in the order handed over, and the gates open in layer order.
        self._gates, self._stepping = [WriteGate() for _ in range(self._layers)], stepping
        for layer, gate in enumerate(self._gates):
            for stream in stepping:
                last = stream.final and layer == self._layers - 1 and stream.rest.empty
                self._send(stream, list(stream.pages), range(layer, layer + 1), last, gate)
        for stream in stepping:
            stream.pages = ()

    def layer_saved(self, name: str) -> None:
        """The forward saved a layer: its writes go, with any before it that did not."""
        position = self._cache.layer_positions.get(name)
        if position is None:
            return  # a layer that shares another's KV: written with it
        for gate in self._gates[: position + 1]:
            gate.open()

    def end(self) -> None:
        """After the forward: every layer of this step goes; a room decode has not asked for
        sends its pages whole with the prompt's end (written when decode asks), and what goes
        after the forward (a recurrent state) goes as the room's last chunk."""
        self._open_gates()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if stream.done or not stream.final or stream.pages:
                continue
            rest = stream.rest
            pages = stream.held + rest.pages
            self._send(stream, pages, None, True, state_indices=rest.slots)
            stream.held = []

    def _open_gates(self) -> None:
        for gate in self._gates:
            gate.open()
        self._gates, self._stepping = [], []

    def _abandon_step(self) -> None:
        """A step whose forward never ended (no `end`): its closed gates hold layers never
        computed, so its rooms fail (their held writes are dropped) rather than the gates
        opening; so does a room whose recurrent state that forward was to write (every
        attention layer saved says nothing of the layers after the last one)."""
        computed = all(gate.is_open for gate in self._gates)
        for stream in self._stepping:  # (done too, with a gate closed: its last layer never went)
            if not computed or (stream.final and not stream.done):
                self._abort(stream, "the forward that computed its layers never ended")
        self._gates, self._stepping = [], []

    def abort(self, request_id: str, reason: str) -> None:
        """The request's room fails; nothing more of it goes out."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None and not stream.done:
            self._abort(stream, reason)

    def _abort(self, stream: Stream, reason: str) -> None:
        stream.done = True
        try:
            stream.sender.abort(reason)
        except Exception as exc:  # never into vLLM's step
            log.error("room %d: %r", stream.sender.room, exc)

    def take(self, request_id: str) -> Stream | None:
        """The request's stream, handed to its send (None: it was never streamed here)."""
        with self._lock:
            return self._streams.pop(request_id, None)

    def _open(self, spec: StreamSpec) -> Stream | None:
        with self._lock:
            stream = self._streams.get(spec.request_id)
        if stream is not None:
            return stream
        try:
            sender = self._prefill.sender(spec.room)
        except Exception as exc:  # the room ended here already: never into vLLM's step
            log.error("request %s: not streamed: %r", spec.request_id, exc)
            return None
        stream = Stream(sender)
        with self._lock:
            self._streams[spec.request_id] = stream
        return stream

    def _send(
        self,
        stream: Stream,
        pages: list[int],
        layers: range | None,
        last: bool,
        gate: WriteGate | None = None,
        state_indices: Sequence[int] = (),
    ) -> None:
        """One chunk (or layer range of one); `last`: the room's last. A send that fails
        fails the room, never the forward."""
        if stream.done:
            return
        try:
            stream.sender.send(
                pages, last=last, layers=layers, gate=gate, state_indices=state_indices
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
