"""A prefill rank's SGLang decode peers, pure: sglang 0.5.23's decode messages (its Mooncake or
NIXL registration, per-room `TransferInfo` and `ABORT`) as the prefill protocol's own events.

sglang's prefill serves a decode rank on what its registration says and takes the rest of the
geometry from its own; so does this rank (`decode_registration_from_sglang`). A transfer
request is kvbridge's with sglang's names. An abort fails the room like kvbridge's; its
`ABORT_ACK` echoes the abort's generation, as sglang's deferred release counts it, once
nothing of the room is in flight; an abort without a generation is owed no ack (sglang's
prefill sends none either). What sglang has no part in — heartbeats, write leases, session
tokens, a status to a dummy request — the peers and rooms leave out for it
(`PrefillSettings.sglang_peers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbridge.cache.sglang_peer import decode_registration_from_sglang
from kvbridge.core.prefill_events import Action
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.native import TransferRequest
from kvbridge.wire.sglang import mooncake, nixl
from kvbridge.wire.sglang.common import AbortAck, AbortNotification

if TYPE_CHECKING:
    from kvbridge.core.prefill_protocol import PrefillProtocol


def request_of(info: mooncake.TransferInfo | nixl.TransferInfo) -> TransferRequest:
    """sglang's per-room request as kvbridge's: the decode rank is named as it registered (its
    Mooncake session, or its NIXL agent); a dummy's aux slot (NIXL sends one) is dropped."""
    peer_id = info.agent_name if isinstance(info, nixl.TransferInfo) else info.mooncake_session_id
    return TransferRequest(
        room=info.room,
        peer_id=peer_id,
        is_dummy=info.is_dummy,
        dst_kv_indices=info.dst_kv_indices,
        dst_aux_index=None if info.is_dummy else info.dst_aux_index,
        dst_state_indices=info.dst_state_indices,
        required_dst_info_num=info.required_dst_info_num,
        decode_prefix_len=info.decode_prefix_len,
    )


class SGLangDecodeMessages:
    """The handlers of sglang's decode messages for one prefill protocol."""

    def __init__(self, protocol: PrefillProtocol) -> None:
        self.protocol = protocol

    def handlers(self) -> dict[type, Callable[[Any, float], list[Action]]]:
        return {
            mooncake.KVArgsRegisterInfo: self.on_registration,
            nixl.KVArgsRegisterInfo: self.on_registration,
            mooncake.TransferInfo: self.on_request,
            nixl.TransferInfo: self.on_request,
            AbortNotification: self.on_abort,
        }

    def on_registration(
        self, info: mooncake.KVArgsRegisterInfo | nixl.KVArgsRegisterInfo, now: float
    ) -> list[Action]:
        protocol = self.protocol
        try:
            registration = decode_registration_from_sglang(
                info, protocol.settings.kv_args, protocol.settings.engine
            )
        except ValueError as exc:
            return protocol.ignore("registration of SGLang decode %s: %s", info.endpoint, exc)
        return protocol.decode_peers.on_registration(registration, now)

    def on_request(
        self, info: mooncake.TransferInfo | nixl.TransferInfo, now: float
    ) -> list[Action]:
        if isinstance(info, mooncake.TransferInfo) and info.dst_device_kv_indices is not None:
            return self.protocol.ignore(
                "request for room %d from SGLang decode %s into a host cache (device page "
                "indices): not supported",
                info.room,
                info.endpoint,
            )
        return self.protocol.on_request(request_of(info), now)

    def on_abort(self, abort: AbortNotification, now: float) -> list[Action]:
        if abort.ack_address is None:
            return self.protocol.ignore(
                "abort of room %d without a decode address: its sender is unknown", abort.room
            )
        rank = self.protocol.rank

        def ack_for(_: object) -> AbortAck | None:
            return AbortAck.answering(abort, rank) if abort.generation is not None else None

        endpoint = tcp_endpoint(*abort.ack_address)
        return self.protocol.abort_by_decode(abort.room, endpoint, "", ack_for, now)
