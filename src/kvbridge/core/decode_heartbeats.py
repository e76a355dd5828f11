"""Decode's side of the heartbeat exchange with kvbridge prefill ranks, pure: answer each beat
at once (the echo is what extends the prefill rank's write lease) and send beats of its own
every interval, each echoing the last sequence heard from that rank. SGLang prefill ranks take
no heartbeat: their liveness comes from their bootstrap's health check."""

from __future__ import annotations

from collections.abc import Container

from kvbridge.core.decode_events import DecodeSettings
from kvbridge.core.liveness import Liveness
from kvbridge.core.protocol import Send
from kvbridge.wire import Heartbeat


class DecodeHeartbeats:
    def __init__(self, settings: DecodeSettings, liveness: Liveness) -> None:
        self._settings, self._liveness = settings, liveness
        self._heard_sequence: dict[str, int] = {}  # prefill endpoint → last heartbeat heard
        self._sent = 0

    def answer(self, beat: Heartbeat) -> Send:
        """The echo of a prefill rank's beat (its sender already checked and seen)."""
        self._heard_sequence[beat.sender_id] = beat.sequence
        settings = self._settings
        return Send(
            beat.sender_id,
            Heartbeat(settings.endpoint, self._sent, settings.lease_ms, beat.sequence),
        )

    def due(self, now: float, without: Container[str]) -> list[Send]:
        """This interval's beats to every watched rank but those `without`, if one is due."""
        if not self._liveness.heartbeat_due(now):
            return []
        self._sent += 1
        settings = self._settings
        return [
            Send(
                endpoint,
                Heartbeat(
                    settings.endpoint,
                    self._sent,
                    settings.lease_ms,
                    self._heard_sequence.get(endpoint),
                ),
            )
            for endpoint in self._liveness.peers
            if endpoint not in without
        ]

    def forget(self, endpoint: str) -> None:
        self._heard_sequence.pop(endpoint, None)
