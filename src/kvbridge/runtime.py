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
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from kvbridge.cache import KVArgs
from kvbridge.cache.regions import MemoryRegion
from kvbridge.config import SGLANG_PROFILES, ManagerConfig
from kvbridge.control.channel import ControlChannel
from kvbridge.core.protocol import ProtocolCore, RoomsChanged, Send
from kvbridge.engines import TransferEngine, create_engine
from kvbridge.metrics import ManagerMetrics, Snapshot
from kvbridge.staging.buffer import StagingBuffer, StagingUnavailable, open_staging
from kvbridge.wire import Message, Receiver

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
        # What the engine names this endpoint (NIXL: the agent's name, which peers use).
        self.endpoint_name = f"{role}-{self.rank}-{uuid.uuid4().hex[:8]}"
        self.engine: TransferEngine = create_engine(
            config.engine, self.endpoint_name, config.host, config.engine_options
        )
        # Prefill gathers staged chunks into this buffer; decode's is the ring prefill writes.
        self.staging: StagingBuffer | None = None
        if config.staging and not config.sglang_peers:  # sglang stages only on GPUs
            try:
                self.staging = open_staging(kv_args, config.staging_bytes, config.staging_kernels)
            except StagingUnavailable as exc:
                log.warning(
                    "%s rank %d: no staging buffer, chunks go token by token: %s",
                    role,
                    self.rank,
                    exc,
                )
        self.lock = threading.Lock()
        # Set whenever a room may have ended or its pages come free: what an owner waiting for
        # that waits on (a vLLM engine step with nothing to compute); may be set spuriously.
        self.activity = threading.Event()
        foreign = (SGLANG_PROFILES[config.engine], Receiver(role)) if config.sglang_peers else None
        self.channel = ControlChannel(
            config.host,
            on_message,
            on_tick,
            name=f"kvbridge-{role}",
            secret=config.secret,
            foreign=foreign,
        )
        self._protocol: ProtocolCore | None = None
        self._threads: list[threading.Thread] = []
        self._execute_own: Callable[[Any], None] = lambda action: None
        self._side_counters: Callable[[], dict[str, float]] = dict
        self.metrics = ManagerMetrics(role, self.rank, self._snapshot)
        self.registration_s = 0.0  # seconds spent registering memory with the engine

    def start(
        self,
        protocol: ProtocolCore,
        execute_own: Callable[[Any], None],
        side_counters: Callable[[], dict[str, float]],
    ) -> None:
        """Serve `protocol`: start the channel's thread and, if configured, the metrics
        server. `execute_own` carries out the actions only this side has; `side_counters`
        (called under the lock) adds the side's own counters to the metrics."""
        self._protocol, self._execute_own, self._side_counters = (
            protocol,
            execute_own,
            side_counters,
        )
        self.channel.start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.host, self.config.metrics_port)

    def handle(self, event: object) -> None:
        """The one way into the protocol: the event, then its actions, in order, under the
        lock (no action blocks: a send is a queue put)."""
        assert self._protocol is not None
        with self.lock:
            self._execute(self._protocol.handle(event, time.monotonic()))

    def _execute(self, actions: Sequence[object]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.channel.send(action.endpoint, action.message)
            elif isinstance(action, RoomsChanged):
                self.activity.set()
            else:
                self._execute_own(action)

    def _snapshot(self) -> Snapshot:
        protocol = self._protocol
        if protocol is None:
            return Snapshot()
        channel = {f"channel_{name}": value for name, value in asdict(self.channel.stats).items()}
        with self.lock:
            stats = protocol.stats
            counters = {
                **channel,
                # Well-formed messages the protocol did not act on (from a peer it does not
                # know, for a room or chunk it has no record of, over a limit), counted where
                # it decides so and reported with the channel's counters.
                "channel_ignored": stats.ignored,
                "peers_declared_dead": stats.peers_declared_dead,
                "heartbeats_missed": protocol.liveness.missed_heartbeats,
                "rooms_started": stats.rooms_started,
                **self._side_counters(),
            }
            return Snapshot(
                counters,
                dict(protocol.rooms_by_state()),
                dict(stats.rooms_finished),
                protocol.chunks_written(),
            )

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register the rank's memory with the engine, once, when the manager starts (never on
        a request's path): timed, logged and reported (`registration_seconds`), since engines
        that pin pages take long at scale."""
        started = time.perf_counter()
        self.engine.register(regions)
        seconds = time.perf_counter() - started
        self.registration_s += seconds
        total = sum(region.length for region in regions)
        self.metrics.observe_registration(self.registration_s, total)
        log.info(
            "%s rank %d: registered %d region(s), %.2f GiB, with %s in %.3f s",
            self.role,
            self.rank,
            len(regions),
            total / 2**30,
            self.engine.name,
            seconds,
        )

    def watch(self, thread: threading.Thread) -> None:
        """A thread of the manager that must stay alive for the rank to be healthy."""
        self._threads.append(thread)

    @property
    def healthy(self) -> bool:
        return self.channel.alive and all(thread.is_alive() for thread in self._threads)

    @property
    def open_rooms(self) -> int:
        """Rooms in the protocol's table: in flight, or ended and not yet cleared."""
        with self.lock:
            return len(self._protocol.rooms) if self._protocol is not None else 0

    def close(self) -> None:
        """Stop the channel, then the engine (its memory deregistered), then the metrics."""
        self.channel.close()
        self.engine.close()
        self.metrics.close()


class RankManager:
    """What both managers answer the same way, from their runtime."""

    runtime: RankRuntime

    @property
    def open_rooms(self) -> int:
        """Rooms in the table: in flight, or ended and not yet cleared by their owner."""
        return self.runtime.open_rooms

    @property
    def healthy(self) -> bool:
        """The control channel and the manager's own threads are alive."""
        return self.runtime.healthy
