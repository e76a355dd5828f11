"""What every rank runs on, prefill or decode: the engine, the control channel, the staging
buffer, the metrics, one lock, and the order they start and stop in.

A manager builds its protocol core (`kvbridge.core`), hands the runtime the channel's
callbacks, and from then on only turns events into the core's actions and executes them. The
lock guards the core: every `handle` call and every action it returns run under it, so actions
are executed in the order the core decided them (sending is a non-blocking queue put).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict

from kvbridge.cache import KVArgs
from kvbridge.config import ManagerConfig
from kvbridge.control.channel import ControlChannel
from kvbridge.engines import TransferEngine, create_engine
from kvbridge.metrics import ManagerMetrics, Snapshot
from kvbridge.staging.buffer import StagingBuffer, StagingUnavailable, open_staging
from kvbridge.wire import Message

log = logging.getLogger("kvbridge.runtime")


class RankRuntime:
    def __init__(
        self,
        role: str,
        kv_args: KVArgs,
        config: ManagerConfig,
        on_message: Callable[[Message], None],
        on_tick: Callable[[], bool],
    ) -> None:
        self.role = role
        self.rank = kv_args.attn_tp_rank
        self.config = config
        config.warn_if_exposed(logging.getLogger(f"kvbridge.{role}"), role)
        self.engine: TransferEngine = create_engine(
            config.engine, f"{role}-{self.rank}-{uuid.uuid4().hex[:8]}", config.host,
            config.engine_options,
        )  # fmt: skip
        # Prefill gathers staged chunks into this buffer; decode's is the ring prefill writes.
        self.staging: StagingBuffer | None = None
        if config.staging:
            try:
                self.staging = open_staging(kv_args, config.staging_bytes, config.staging_kernels)
            except StagingUnavailable as exc:
                log.warning("%s rank %d: no staging buffer, chunks go token by token: %s",
                            role, self.rank, exc)  # fmt: skip
        self.lock = threading.Lock()
        # Set whenever a room may have ended or its pages come free: what an owner waiting for
        # that waits on (a vLLM engine step with nothing to compute); may be set spuriously.
        self.activity = threading.Event()
        self.channel = ControlChannel(
            config.host, on_message, on_tick, name=f"kvbridge-{role}", secret=config.secret
        )
        self._side_snapshot: Callable[[], Snapshot] | None = None
        self.metrics = ManagerMetrics(role, self.rank, self._snapshot)

    def start(self, side_snapshot: Callable[[], Snapshot]) -> None:
        """Start the channel's thread and, if configured, the metrics server. `side_snapshot`
        (called under the lock) gives the side's own counters and rooms; the channel's
        counters are added to them here."""
        self._side_snapshot = side_snapshot
        self.channel.start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.host, self.config.metrics_port)

    def _snapshot(self) -> Snapshot:
        if self._side_snapshot is None:
            return Snapshot()
        with self.lock:
            side = self._side_snapshot()
        channel = {f"channel_{name}": value for name, value in asdict(self.channel.stats).items()}
        # Well-formed messages the protocol did not act on (from a peer it does not know, for
        # a room or chunk it has no record of, over a limit) are counted where it decides so,
        # and reported with the channel's counters.
        channel["channel_ignored"] = side.counters.get("ignored", 0)
        counters = {**channel, **{k: v for k, v in side.counters.items() if k != "ignored"}}
        return Snapshot(counters, side.rooms_by_state, side.rooms_finished)

    @property
    def healthy(self) -> bool:
        return self.channel.alive

    def close(self) -> None:
        """Stop the channel, then the engine (its memory deregistered), then the metrics."""
        self.channel.close()
        self.engine.close()
        self.metrics.close()
