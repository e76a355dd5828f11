"""How much of the engine thread's time in engine calls was spent off a CPU, pure.

Engine calls that start or poll a transfer release the GIL (NIXL's do), and the calling thread
then waits to take it back while another thread of the process runs Python — up to the
interpreter's switch interval when that thread never blocks (a serving engine's scheduler
loop) — or waits for a CPU on a busy host. Their wall time less their CPU time is that wait.
The engine thread adds each stretch of engine calls here; a window in which most of the time
went to waiting is worth a warning, since the transfers then run at a fraction of the engine's
speed for a reason no other figure shows (`benchmarks/busy_host.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Time in engine calls that makes one window, how much of a window spent waiting is worth a
# warning, and how often one may be given.
WINDOW_S = 0.25
WARN_SHARE = 0.5
WARN_EVERY_S = 60.0


@dataclass
class EngineWaits:
    """Totals of time in engine calls (`busy_s`) and of the part off a CPU (`waited_s`)."""

    busy_s: float = 0.0
    waited_s: float = 0.0
    _window_busy_s: float = 0.0
    _window_waited_s: float = 0.0
    _warned_at: float | None = None

    def add(self, wall_s: float, cpu_s: float, now: float) -> float | None:
        """One stretch of engine calls: `wall_s` long, `cpu_s` of it on a CPU. The share of
        the window just completed that went to waiting, when it is worth a warning (at most
        once per `WARN_EVERY_S`); else None."""
        waited = max(wall_s - cpu_s, 0.0)  # CPU clocks may read a hair past the wall one
        self.busy_s += wall_s
        self.waited_s += waited
        self._window_busy_s += wall_s
        self._window_waited_s += waited
        if self._window_busy_s < WINDOW_S:
            return None
        share = self._window_waited_s / self._window_busy_s
        self._window_busy_s = self._window_waited_s = 0.0
        if share < WARN_SHARE:
            return None
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_S:
            return None
        self._warned_at = now
        return share
