"""What a decode rank says to an SGLang prefill rank (sglang 0.5.23, Mooncake or NIXL), pure.

An SGLang prefill rank gets sglang's own registration, one `TransferInfo` per room (the aux
slot in every request that writes, as sglang's decode sends it; `decode_prefix_len` 0 for
none), and `ABORT` with a generation it echoes in its `ABORT_ACK`. It carries no session
token, heartbeat or write lease: its statuses are accepted by (room, prefill rank) from the
ranks the room asked, and it is never sent a kvbridge message (one foreign frame list stops an
sglang prefill rank's listener thread for good).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.core.decode_events import DecodeSettings, WriteAux
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.protocol import RoomsChanged, Send
from kvbridge.wire.messages import FailureKind
from kvbridge.wire.sglang import nixl
from kvbridge.wire.sglang.common import AbortAck, AbortNotification, AuxData
from kvbridge.wire.sglang.mooncake import TransferInfo

# How long after an abort an SGLang writer that never acknowledged counts as stopped: sglang's
# own decode frees a room's pages this long after an unanswered abort
# (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT's default).
ABORT_RELEASE_S = 30.0


@dataclass(frozen=True)
class SGLangAsk:
    """What a room asks of one SGLang prefill rank, whichever backend's request carries it."""

    room: int
    host: str
    control_port: int
    pages: npt.NDArray[np.int32]
    aux_index: int | None
    state_indices: tuple[int, ...]
    required_dst_info_num: int
    decode_prefix_len: int | None
    dummy: bool

    @property
    def page_indices(self) -> npt.NDArray[np.int32]:
        return np.empty(0, dtype=np.int32) if self.dummy else self.pages

    @property
    def state_slots(self) -> list[list[int]]:
        return [list(self.state_indices)] if self.state_indices and not self.dummy else []


@dataclass(frozen=True)
class SGLangMooncakePeer:
    """An SGLang prefill rank of the Mooncake backend this decode rank registered with."""

    session_id: str  # this decode rank's Mooncake session, named in every request

    def request(self, ask: SGLangAsk) -> TransferInfo:
        """sglang's Mooncake request: a dummy has neither pages nor an aux slot."""
        return TransferInfo(
            room=ask.room,
            endpoint=ask.host,
            dst_port=ask.control_port,
            mooncake_session_id=self.session_id,
            dst_kv_indices=ask.page_indices,
            dst_aux_index=None if ask.dummy else (ask.aux_index or 0),
            dst_state_indices=ask.state_slots,
            required_dst_info_num=ask.required_dst_info_num,
            decode_prefix_len=ask.decode_prefix_len or 0,
        )


@dataclass(frozen=True)
class SGLangNixlPeer:
    """An SGLang prefill rank of the NIXL backend this decode rank registered with."""

    agent_name: str  # this decode rank's NIXL agent, named in every request

    def request(self, ask: SGLangAsk) -> nixl.TransferInfo:
        """sglang's NIXL request: the aux slot in every one, dummies' too (its prefill reads
        it as an integer whatever it is), and the explicit dummy flag."""
        return nixl.TransferInfo(
            room=ask.room,
            endpoint=ask.host,
            dst_port=ask.control_port,
            agent_name=self.agent_name,
            dst_kv_indices=ask.page_indices,
            dst_aux_index=ask.aux_index or 0,
            required_dst_info_num=ask.required_dst_info_num,
            dst_state_indices=ask.state_slots,
            decode_prefix_len=ask.decode_prefix_len or 0,
            dummy_rank=ask.dummy,
        )


SGLangPeer = SGLangMooncakePeer | SGLangNixlPeer  # how a room's requests to the rank read


class SGLangPeers:
    """The SGLang prefill ranks a decode rank registered with (by control endpoint), the
    generations of its aborts toward them, and the messages only they send. `rooms`: the
    protocol's own table, shared (as `DecodeRing` shares it)."""

    def __init__(
        self,
        settings: DecodeSettings,
        rooms: dict[int, DecodeRoom],
        ignore: Callable[..., list[Any]],
    ) -> None:
        self.by_endpoint: dict[str, SGLangPeer] = {}
        self._settings, self._rooms, self._ignore = settings, rooms, ignore
        self._generation = 0

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self.by_endpoint

    def of_room(self, state: DecodeRoom) -> SGLangPeer | None:
        """The SGLang peer the room's prefill group speaks to (None: kvbridge ranks)."""
        return next(
            (self.by_endpoint[e] for e in state.endpoints.values() if e in self.by_endpoint), None
        )

    def asked(self, state: DecodeRoom | None, prefill_rank: int | None) -> bool:
        """Whether the room asked this SGLang prefill rank (its tokenless messages count)."""
        if state is None or prefill_rank is None:
            return False
        return state.endpoints.get(prefill_rank) in self.by_endpoint

    def aborts(self, state: DecodeRoom, now: float) -> list[Send]:
        """The room's abort toward its SGLang prefill ranks, with a new generation: to every
        rank it asked that has not settled, dummies and ranks declared dead included (sglang's
        decode tells every rank it asked; a rank only thought dead still stops). An unsettled
        writer counts as stopped once it acknowledged, or ABORT_RELEASE_S from now whatever it
        said (sglang's own decode gives up waiting for acks as late)."""
        self._generation += 1
        state.abort_generation = self._generation
        for rank in state.expected_ranks - state.settled:
            released = now + ABORT_RELEASE_S
            state.dead_until[rank] = min(state.dead_until.get(rank, released), released)
        settings = self._settings
        message = AbortNotification(
            state.room, settings.host, settings.control_port, self._generation
        )
        endpoints = {e for rank, e in state.endpoints.items() if rank not in state.settled}
        return [Send(endpoint, message) for endpoint in sorted(endpoints)]

    def on_abort_ack(self, ack: AbortAck, now: float) -> list[Send | RoomsChanged]:
        """An SGLang prefill rank confirms the room's abort drained: it counts only with the
        generation of the room's last abort, as sglang's own decode counts it (a
        generation-less ack is what an sglang prefill without deferred release sends before
        its writes drained)."""
        state = self._rooms.get(ack.room)
        if state is None or ack.prefill_rank is None or not self.asked(state, ack.prefill_rank):
            return self._ignore("ABORT_ACK for room %d from no rank it asked", ack.room)
        if ack.generation is None or ack.generation != state.abort_generation:
            return self._ignore(
                "ABORT_ACK for room %d of generation %s, not %s",
                ack.room,
                ack.generation,
                state.abort_generation,
            )
        state.on_abort_ack(ack.prefill_rank)
        return [RoomsChanged()]

    def on_aux_data(self, message: AuxData, now: float) -> list[Send | WriteAux | RoomsChanged]:
        """sglang sends the aux slot over ZMQ with SGLANG_MOONCAKE_SEND_AUX_TCP (before its
        status, on the same socket): copied into the slot the room asked for. Only into that
        slot, of a room still transferring; bytes that do not fit the slot, or aux buffers in
        GPU memory, fail the room rather than let it succeed with its aux slot unwritten."""
        state = self._rooms.get(message.room)
        if state is None or self.of_room(state) is None or state.status.finished:
            return self._ignore("AUX_DATA for room %d, not an SGLang room", message.room)
        if message.aux_index != state.aux_index:
            return self._ignore(
                "AUX_DATA for room %d into slot %d, not its slot %s",
                message.room,
                message.aux_index,
                state.aux_index,
            )
        geometry = self._settings.aux_geometry
        problem = None
        if not self._settings.aux_in_host_memory:
            problem = "into aux buffers in GPU memory: not taken here"
        elif message.buffer_index >= len(geometry):
            problem = f"for aux buffer {message.buffer_index}; this rank has {len(geometry)}"
        elif len(message.data) != geometry[message.buffer_index][0]:
            problem = (
                f"of {len(message.data)} bytes for a slot of "
                f"{geometry[message.buffer_index][0]} (aux buffer {message.buffer_index})"
            )
        elif not 0 <= message.aux_index < geometry[message.buffer_index][1]:
            problem = f"for slot {message.aux_index} of {geometry[message.buffer_index][1]}"
        if problem is None:
            return [WriteAux(message.buffer_index, message.aux_index, message.data)]
        reason = f"the SGLang prefill sent the aux slot over ZMQ {problem}"
        state.status.fail(FailureKind.INCOMPATIBLE, f"room {message.room}: {reason}")
        return [*self.aborts(state, now), RoomsChanged()]
