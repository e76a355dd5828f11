"""Liveness between ranks, pure: who was heard from when, and who fell silent.

Each rank sends a heartbeat to every peer it works with every `interval_s`; a peer not heard
from for `timeout_s` is declared dead once (its rooms fail with the reason), and comes back to
life when it is heard from again (a healed partition needs no restart). Silence is counted
only while the rank itself runs: a rank that was stopped or starved does not blame its peers
for what it could not hear.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Liveness:
    interval_s: float
    timeout_s: float
    _last_seen: dict[str, float] = field(default_factory=dict)
    _dead: set[str] = field(default_factory=set)
    _heard: set[str] = field(default_factory=set)  # seen at least once (not only watched)
    _last_beat: float = float("-inf")
    # When `expired` last looked: a rank that did not run for longer than an interval (stopped,
    # descheduled, a paused VM) has not heard its peers over that time through no fault of
    # theirs.
    _last_check: float | None = None
    # Heartbeat intervals that passed without a sign of life from a peer that did come back
    # (one interval of jitter tolerated): the early warning before a peer is declared dead.
    missed_heartbeats: int = 0

    def watch(self, peer: str, now: float) -> None:
        """Start watching a peer, as if just heard from (a grace period of one timeout)."""
        self._last_seen.setdefault(peer, now)

    def seen(self, peer: str, now: float) -> bool:
        """Record a sign of life; True if the peer had been declared dead."""
        last = self._last_seen.get(peer)
        if peer in self._heard and last is not None and now - last > 2 * self.interval_s:
            self.missed_heartbeats += int((now - last) // self.interval_s) - 1
        self._heard.add(peer)
        self._last_seen[peer] = now
        if peer in self._dead:
            self._dead.discard(peer)
            return True
        return False

    def heartbeat_due(self, now: float) -> bool:
        """Whether it is time to send this rank's heartbeats (and note that they are sent)."""
        if now - self._last_beat >= self.interval_s:
            self._last_beat = now
            return True
        return False

    def expired(self, now: float) -> list[tuple[str, float]]:
        """Peers silent for longer than the timeout, each reported once: (peer, silent for).
        Silence counts only while this rank ran: time beyond an interval since the last call
        (this rank stopped or starved) is credited to every peer, which then has the rest of
        its timeout to be heard from (a stalled rank would otherwise declare every peer dead
        the moment it runs again, before their queued or next heartbeats are read)."""
        if self._last_check is not None:
            stalled = now - self._last_check - self.interval_s
            if stalled > 0:
                for peer in self._last_seen:
                    self._last_seen[peer] = min(now, self._last_seen[peer] + stalled)
        self._last_check = now
        newly_dead = []
        for peer, last in self._last_seen.items():
            if peer not in self._dead and now - last > self.timeout_s:
                self._dead.add(peer)
                newly_dead.append((peer, now - last))
        return newly_dead

    def silence(self, who: str, silent_s: float) -> str:
        """Why a peer was declared dead, in words (what its rooms fail with)."""
        return f"{who} silent for {silent_s:.1f} s (peer timeout {self.timeout_s:g} s)"

    def alive(self, peer: str) -> bool:
        return peer not in self._dead

    @property
    def peers(self) -> list[str]:
        return list(self._last_seen)

    def forget(self, peer: str) -> None:
        self._last_seen.pop(peer, None)
        self._dead.discard(peer)
        self._heard.discard(peer)
