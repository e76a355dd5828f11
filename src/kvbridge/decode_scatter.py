"""Decode's scatter thread: copies staged chunks from the staging ring into the room's pages
(heterogeneous TP), one at a time, and tells the protocol each one ended."""

from __future__ import annotations

import logging
import queue
import threading
import time

from kvbridge.cache import KVArgs
from kvbridge.cache.plan import dst_token_rows
from kvbridge.core.decode_events import ChunkScattered, DecodeStats, ScatterChunk
from kvbridge.core.decode_protocol import DecodeProtocol
from kvbridge.runtime import RankRuntime

log = logging.getLogger("kvbridge.decode")


class ScatterThread:
    def __init__(
        self, kv_args: KVArgs, runtime: RankRuntime, protocol: DecodeProtocol, stats: DecodeStats
    ) -> None:
        self._kv_args, self._runtime, self._protocol, self._stats = (
            kv_args,
            runtime,
            protocol,
            stats,
        )
        self._queue: queue.SimpleQueue[ScatterChunk | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, name="kvbridge-decode-scatter", daemon=True
        )
        self.thread.start()

    def put(self, scatter: ScatterChunk) -> None:
        self._queue.put(scatter)

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join(timeout=10.0)

    def _run(self) -> None:
        while True:
            scatter = self._queue.get()
            if scatter is None:
                return
            failed = False
            try:
                self._scatter(scatter)
            except Exception:  # a broken chunk fails its room, never this thread
                log.exception(
                    "scatter of room %d chunk %d failed",
                    scatter.ready.room,
                    scatter.ready.chunk_idx,
                )
                failed = True
            self._runtime.handle(ChunkScattered(scatter.ready, scatter.allocation, failed))

    def _scatter(self, scatter: ScatterChunk) -> None:
        ready, ring = scatter.ready, self._runtime.staging
        assert ring is not None
        with self._runtime.lock:
            if not self._protocol.scatter_wanted(ready.room):
                return
        args = self._kv_args
        rows = dst_token_rows(
            ready.token_start,
            ready.token_count,
            scatter.dst_pages,
            args.page_size,
            args.dcp_size,
            args.dcp_rank,
        )
        # A source of every head sends whole rows (`STAGED_WHOLE_ROWS`), else its heads' columns.
        every_head = scatter.source.heads.count == args.kv_heads
        column, width = (
            (0, args.token_bytes) if every_head else scatter.source.columns(args.head_bytes, "dst")
        )
        started = time.perf_counter()
        ring.scatter(scatter.allocation.offset, scatter.allocation.end, rows, column, width)
        with self._runtime.lock:
            self._stats.scattered_chunks += 1
            self._stats.scatter_s += time.perf_counter() - started
