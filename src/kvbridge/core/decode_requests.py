"""What a decode rank asks of each prefill rank when a room opens, and the room it then waits
on, pure (`DecodeProtocol` keeps the table of rooms)."""

from __future__ import annotations

import numpy as np

from kvbridge.core.decode_events import DecodeSettings, RoomOpened
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.decode_sglang import SGLangAsk, SGLangPeer
from kvbridge.core.room import SKIPPED_PAGE, RoomStatus
from kvbridge.wire import KVPoll, Message, TransferRequest


def room_requests(
    event: RoomOpened, settings: DecodeSettings, sglang: SGLangPeer | None
) -> list[tuple[int, Message]]:
    """One request to each prefill rank this decode rank reads heads from, a dummy to the
    ranks it only tells about the room, in the prefill group's own words (`sglang`: an SGLang
    group). Toward kvbridge ranks the first source alone writes the aux slot; every source
    sends its shard of the state slots (at equal TP that is one source and the whole slot)."""
    route, pages = event.route, event.pages
    first_source = route.sources[0].prefill_rank if route.sources else None

    def request(prefill_rank: int, dummy: bool) -> Message:
        if sglang is not None:
            ask = SGLangAsk(
                room=event.room,
                host=settings.host,
                control_port=settings.control_port,
                pages=pages,
                aux_index=event.aux_index,
                state_indices=event.state_indices,
                required_dst_info_num=event.required[prefill_rank],
                decode_prefix_len=event.decode_prefix_len,
                dummy=dummy,
            )
            return sglang.request(ask)
        state_slots = [list(event.state_indices)] if event.state_indices and not dummy else []
        return TransferRequest(
            room=event.room,
            peer_id=settings.peer_id,
            is_dummy=dummy,
            dst_kv_indices=np.empty(0, dtype=np.int32) if dummy else pages,
            dst_aux_index=event.aux_index if prefill_rank == first_source else None,
            dst_state_indices=state_slots,
            required_dst_info_num=event.required[prefill_rank],
            decode_prefix_len=event.decode_prefix_len,
        )

    requests = [(s.prefill_rank, request(s.prefill_rank, False)) for s in route.sources]
    return requests + [(rank, request(rank, True)) for rank in route.dummies]


def opened_room(
    event: RoomOpened, settings: DecodeSettings, sglang: SGLangPeer | None, now: float
) -> DecodeRoom:
    """The room, transferring: it waits for every reporting rank, and for the last write's
    notification of each source where the engine notifies (SGLang's writes carry none for this
    rank), until `transfer_timeout_s` from now."""
    route, pages = event.route, event.pages
    sources = {source.prefill_rank: source for source in route.sources}
    notifies = settings.engine_notifies and sglang is None
    state = DecodeRoom(
        room=event.room,
        expected_ranks=(
            frozenset(route.prefill_ranks) if event.reporting is None else event.reporting
        ),
        notifying_ranks=frozenset(sources) if notifies else frozenset(),
        deadline=now + settings.transfer_timeout_s,
        # Staged chunks name decode's pages by their place among those prefill fills.
        dst_pages=pages[pages != SKIPPED_PAGE].astype(np.int64),
        sources=sources,
        endpoints=dict(event.endpoints),
        status=RoomStatus(KVPoll.WaitingForInput),
        aux_index=event.aux_index,
    )
    state.status.advance(KVPoll.Transferring)
    return state
