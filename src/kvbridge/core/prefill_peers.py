"""A prefill rank's decode peers, pure: admission (caps, duplicates, pairing), the engine
connection, the heartbeats this rank sends and the write lease their echoes grant, and who
fell silent. `PrefillProtocol` asks it about peers and executes what it returns."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.cache import GeometryError, KVArgs, PlanError
from kvbridge.cache.pairing import STAGED_WHOLE_ROWS, Pairing, PathReason, pair
from kvbridge.cache.peer import kv_args_of
from kvbridge.core.liveness import Liveness
from kvbridge.core.prefill_events import Action, Connect, Connected, PrefillSettings
from kvbridge.core.protocol import Send
from kvbridge.core.room import Failure
from kvbridge.wire import (
    FailureKind,
    Heartbeat,
    KVPoll,
    Registration,
    RoomLease,
    StagingResponse,
    TransferRequest,
    TransferStatus,
)
from kvbridge.wire.address import tcp_endpoint

log = logging.getLogger("kvbridge.prefill")
# Heartbeat send times kept for decode's echoes (heartbeats are 0.5 s apart by default).
MAX_BEATS_REMEMBERED = 64
# Without a secret anyone who reaches the port can register: registered decode peers are
# capped.
MAX_DECODE_PEERS = 1024

Ignore = Callable[..., list[Any]]  # counts and logs a message this rank does not act on


@dataclass
class DecodePeer:
    registration: Registration
    endpoint: str
    kv_args: KVArgs | None = None
    pairing: Pairing | None = None
    connected: bool = False
    error: Failure | None = None
    # Until when (monotonic) this rank may write to the peer: set from decode's echo of one of
    # this rank's heartbeats, counted from when that heartbeat was sent; 0: never granted.
    lease_until: float = 0.0
    # When this rank last sent the peer a heartbeat out of schedule to renew a lease that ran
    # out (at most one per heartbeat interval).
    renewal_sent_at: float = float("-inf")

    @property
    def token(self) -> bytes:
        return self.registration.session_token


class PrefillPeers:
    """The decode peers of one prefill rank, by peer id and by control endpoint."""

    def __init__(self, settings: PrefillSettings, ignore: Ignore) -> None:
        self.settings = settings
        self._ignore = ignore
        self.by_id: dict[str, DecodePeer] = {}
        self._id_by_endpoint: dict[str, str] = {}
        self.liveness = Liveness(settings.heartbeat_interval_s, settings.peer_timeout_s)
        self._heartbeats = 0
        self._beats_sent: OrderedDict[int, float] = OrderedDict()  # sequence → when sent

    def get(self, peer_id: str) -> DecodePeer | None:
        return self.by_id.get(peer_id)

    def at(self, endpoint: str) -> DecodePeer | None:
        """The registered peer whose control endpoint this is."""
        peer_id = self._id_by_endpoint.get(endpoint)
        return self.by_id.get(peer_id) if peer_id is not None else None

    def lease_problem(self, peer_id: str, now: float) -> str | None:
        """Why this rank may not write to the peer now (its lease ran out), or None. A plain
        read, safe without the manager's lock: a peer's record is only replaced whole (a new
        registration) and its `lease_until` only grows. An SGLang decode grants no lease:
        writes to it go out once it registered, as sglang's own prefill writes."""
        if self.settings.sglang_peers:
            return None
        peer = self.by_id.get(peer_id)
        if peer is not None and now < peer.lease_until:
            return None
        if peer is None or not peer.lease_until:
            return f"decode {peer_id} has not answered a heartbeat (no write lease)"
        return (
            f"the write lease on decode {peer_id} ran out {now - peer.lease_until:.1f} s ago "
            "(not heard from it): this rank stopped writing to it"
        )

    def heard(self, event: object, now: float) -> None:
        """Any message from a registered decode peer is a sign of life."""
        sender: str | None = None
        if isinstance(event, (Registration, TransferRequest)):
            sender = event.peer_id
        elif isinstance(event, Heartbeat):
            sender = self._beat_sender(event)
        elif isinstance(event, StagingResponse):
            sender = event.session_id
        elif isinstance(event, RoomLease):
            sender = self._id_by_endpoint.get(event.sender_id)
        if sender is not None and sender in self.by_id:
            self.liveness.seen(sender, now)

    def on_registration(self, registration: Registration, now: float) -> list[Action]:
        known = self.by_id.get(registration.peer_id)
        twin = next(
            (
                other
                for other in self.by_id.values()
                if other.registration.engine_descriptor == registration.engine_descriptor
            ),
            None,
        )
        if known is not None:
            # A decode rank registers once; its peer id names one process. A different
            # registration under a known id is someone else's; the same one again means decode
            # forgot this rank (it declared it dead): a heartbeat now renews the write lease.
            if known.registration != registration:
                return self._ignore(
                    "a changed registration for known decode %s", registration.peer_id
                )
            return self.heartbeats_to([known], now)
        if twin is not None or len(self.by_id) >= MAX_DECODE_PEERS:
            return self._ignore(
                "registration of %s: %s",
                registration.peer_id[:100],
                "engine endpoint already registered by " + twin.registration.peer_id
                if twin
                else f"{MAX_DECODE_PEERS} decode peers already",
            )
        endpoint = tcp_endpoint(registration.host, registration.control_port)
        peer = DecodePeer(registration, endpoint)
        try:
            peer.kv_args = kv_args_of(registration)
            whole_rows = STAGED_WHOLE_ROWS in registration.capabilities
            peer.pairing = pair(
                self.settings.kv_args, peer.kv_args, self.settings.write_path, whole_rows
            )
            pairing = peer.pairing
            why = PathReason.COST if pairing.coalescible else pairing.reason
            log.info(
                "decode %s: chunks go %s (%s)",
                registration.peer_id[:100],
                pairing.choice,
                why.value,
            )
        except (GeometryError, PlanError) as exc:
            reason = f"decode {registration.peer_id} cannot be served: {exc}"
            peer.error = Failure(FailureKind.INCOMPATIBLE, reason)
            log.error("%s", reason)
        if registration.engine != self.settings.engine:
            peer.error = Failure(
                FailureKind.INCOMPATIBLE,
                f"decode {registration.peer_id} uses engine {registration.engine}, this prefill "
                f"rank {self.settings.engine}",
            )
        self.by_id[registration.peer_id] = peer
        self._id_by_endpoint[endpoint] = registration.peer_id
        if not self.settings.sglang_peers:  # an SGLang decode sends nothing to be heard by
            self.liveness.seen(registration.peer_id, now)
        actions = self.heartbeats_to([peer], now)  # its echo grants the first lease
        if peer.error is None and peer.kv_args is not None:
            actions.append(
                Connect(registration.peer_id, registration.engine_descriptor, peer.kv_args)
            )
        return actions

    def on_connected(self, event: Connected, now: float) -> list[Action]:
        peer = self.by_id.get(event.peer_id)
        if peer is None:
            return []
        if event.error is None:
            peer.connected = True
            return []
        reason = f"cannot connect to decode {event.peer_id}: {event.error}"
        peer.error = Failure(FailureKind.ENGINE, reason)
        log.error("%s", reason)
        return []

    def renew_lease(self, peer: DecodePeer, now: float) -> list[Action]:
        """A heartbeat now, out of schedule, to a peer that asks for a write while the lease
        on it ran out (this rank or the peer stalled, or the link did): its echo renews the
        lease within a round trip, where the next scheduled heartbeat could be an interval
        away and the write waits for it. At most one per heartbeat interval."""
        if not peer.lease_until or now < peer.lease_until:
            return []  # never granted (registration's heartbeat is on its way), or valid
        if now - peer.renewal_sent_at < self.settings.heartbeat_interval_s:
            return []
        peer.renewal_sent_at = now
        return self.heartbeats_to([peer], now)

    def status_to(
        self,
        peer: DecodePeer,
        room: int,
        poll: KVPoll,
        reason: str = "",
        kind: FailureKind | None = None,
    ) -> Send:
        """A room's status for the peer: with its token and the failure's kind for a kvbridge
        decode; sglang's frames carry neither, only the reason (which its decode reads when
        present, though its own prefill sends none)."""
        if self.settings.sglang_peers:
            return Send(peer.endpoint, TransferStatus(room, poll, self.settings.rank, reason))
        status = TransferStatus(room, poll, self.settings.rank, reason, peer.token, kind)
        return Send(peer.endpoint, status)

    def _beat_sender(self, message: Heartbeat) -> str | None:
        """The decode peer a heartbeat is from: its sender_id is the sender's control
        endpoint."""
        return self._id_by_endpoint.get(message.sender_id)

    def on_heartbeat(self, message: Heartbeat, now: float) -> list[Action]:
        """Decode's heartbeat echoes the last of ours it heard: the write lease runs from when
        that one was sent (a heartbeat read late, after a stall, extends nothing)."""
        peer_id = self._beat_sender(message)
        peer = self.by_id.get(peer_id) if peer_id is not None else None
        sent = self._beats_sent.get(message.ack_sequence) if message.ack_sequence else None
        if peer is not None and sent is not None:
            peer.lease_until = max(peer.lease_until, sent + message.lease_ms / 1000)
        return []

    def heartbeats_to(self, peers: Sequence[DecodePeer], now: float) -> list[Action]:
        if self.settings.sglang_peers:
            return []  # sglang's decode has no heartbeat: one would stop its listener
        self._heartbeats += 1
        self._beats_sent[self._heartbeats] = now
        while len(self._beats_sent) > MAX_BEATS_REMEMBERED:
            self._beats_sent.popitem(last=False)
        lease_ms = int(self.settings.peer_timeout_s * 1000)
        endpoint, sequence = self.settings.endpoint, self._heartbeats
        beats = [
            (peer, Heartbeat(endpoint, sequence, lease_ms, session_token=peer.token))
            for peer in peers
        ]
        return [Send(peer.endpoint, beat) for peer, beat in beats]

    def on_tick(self, now: float) -> list[Action]:
        """Heartbeats to every decode peer when they are due."""
        if self.liveness.heartbeat_due(now):
            return self.heartbeats_to(list(self.by_id.values()), now)
        return []
