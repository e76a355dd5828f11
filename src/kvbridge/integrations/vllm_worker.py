"""The worker side of kvbridge's vLLM connector: kvbridge's managers over this worker's KV
cache, the inbox where the scheduler hands it prefill's sends, and how long an idle engine
step waits for transfers to end (prefill's sends are kept by `vllm_sends.Sends`, decode's
loads by `vllm_loads.Loads`). It imports nothing from vLLM;
`kvbridge.integrations.vllm` builds it with what vLLM told it."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.decode import DecodeManager
from kvbridge.integrations.vllm_cache import VLLMCache
from kvbridge.integrations.vllm_handoff import SendInbox
from kvbridge.integrations.vllm_kv_views import MambaState, describe_kv_caches
from kvbridge.integrations.vllm_loads import Loads
from kvbridge.integrations.vllm_options import ConnectorOptions, StepTimes, cpu_list
from kvbridge.integrations.vllm_sends import Sends
from kvbridge.integrations.vllm_stats import WRITE_BYTES, WRITE_SECONDS, ConnectorCounters, Interval
from kvbridge.integrations.vllm_steps import SendSpec, StepMetadata, StreamAbort, StreamSpec
from kvbridge.integrations.vllm_streams import Streams, stream_positions
from kvbridge.prefill import PrefillManager
from kvbridge.wire.messages import MemoryKind

log = logging.getLogger("kvbridge.vllm")
T = TypeVar("T")


def _unpin() -> None:
    """Let the calling thread run on every CPU this process may use. vLLM's CPU worker binds
    its compute threads to cores, and threads inherit the binding of the thread that starts
    them: kvbridge's control, transfer and I/O threads would then share one core with a
    worker that spins between steps, and starve (heartbeats late, leases running out)."""
    try:
        allowed = Path("/sys/fs/cgroup/cpuset.cpus.effective").read_text().strip()
        cpus = cpu_list(allowed) if allowed else set(range(os.cpu_count() or 1))
    except (OSError, ValueError):
        cpus = set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # a narrower cgroup than it said, or no permission
        log.debug("kvbridge threads keep vLLM's CPU binding: %s", exc)


def _unpinned(build: Callable[[], T]) -> T:
    """`build()` run in a thread that `_unpin` released: every thread it starts (kvbridge's,
    ZMQ's, the engine's) runs on any CPU."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        _unpin()
        try:
            result.append(build())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="kvbridge-vllm-start")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker knows of itself and its instance."""

    produces: bool
    consumes: bool
    tp_rank: int
    tp_size: int
    pp_rank: int
    total_kv_heads: int
    use_mla: bool
    block_size: int  # of the attention groups' blocks (a state group's may be larger)
    state_layers: frozenset[str]
    state_groups: frozenset[int]  # the transfer groups that keep a recurrent state
    # Decode first: the layers of the KV cache group that streams during the forward (empty:
    # none does; None: every attention layer, the one group).
    stream_layers: frozenset[str] | None
    mamba: MambaState | None  # how a Mamba-2 state splits between TP sizes, if known
    num_blocks: int | None  # vLLM's blocks (its kernels may split each into smaller ones)
    # The prefill instance's bootstrap port (each DP rank has its own; 0: a free port).
    bootstrap_port: int
    multi_group: bool


class WorkerSide:
    """kvbridge's managers for this worker's KV caches and the transfers in flight through
    them: sends here, decode's loads in `Loads`."""

    def __init__(self, config: WorkerConfig, options: ConnectorOptions) -> None:
        self.config = config
        self.options = options
        self.cache: VLLMCache | None = None
        self.kv_caches: dict[str, Any] = {}
        self.prefill: PrefillManager | None = None
        self.decode: DecodeManager | None = None
        self.inbox: SendInbox | None = None
        # Owned here, beside the managers it opens rooms on, so that close() stops it first.
        self._opener = ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kvbridge-vllm-open", initializer=_unpin
        )
        self._last_step_ended: float | None = None  # when get_finished last returned
        self._step_times = StepTimes()
        self.counters = ConnectorCounters()
        self._reported = ConnectorCounters()  # as of the last get_kv_connector_stats
        self._interval = Interval()
        self._loads = Loads(self.counters, self._interval, self._opener)
        self._sends = Sends(self.counters, self._interval, config.pp_rank, config.state_groups)
        self._streams: Streams | None = None  # prefill, decode first: rooms written by layer

    @property
    def bootstrap_url(self) -> str | None:
        if self.prefill is None or self.config.tp_rank != 0:
            return None
        return self.prefill.bootstrap_url

    def register(self, kv_caches: dict[str, Any]) -> None:
        config = self.config
        self.kv_caches = dict(kv_caches)
        self.cache = describe_kv_caches(
            kv_caches,
            use_mla=config.use_mla,
            total_kv_heads=config.total_kv_heads,
            attn_tp_rank=config.tp_rank,
            attn_tp_size=config.tp_size,
            block_size=config.block_size,
            state_layers=config.state_layers,
            num_blocks=config.num_blocks,
            mamba=config.mamba,
        )
        args = self.cache.kv_args
        if config.produces:
            if config.tp_size > 1 and config.bootstrap_port == 0:
                raise RuntimeError(
                    "kvbridge with TP > 1 on a prefill instance needs "
                    "kv_connector_extra_config.bootstrap_port: every rank registers there"
                )
            url = f"http://{self.options.manager.host}:{config.bootstrap_port}"
            manager_config = dataclasses.replace(
                self.options.manager_config(
                    run_bootstrap=config.tp_rank == 0,
                    bootstrap_url=None if config.tp_rank == 0 else url,
                ),
                bootstrap_port=config.bootstrap_port,
            )
            self.prefill = _unpinned(lambda: PrefillManager(args, manager_config))
            self.prefill.metrics.keep_writes()  # for vLLM's metrics (take_interval)
            # Layer by layer only where a saved layer's KV is in place when vLLM says so (CPU
            # attention runs synchronously; on a GPU its kernels are only queued then).
            streamed = config.stream_layers
            if streamed is None:
                streamed = frozenset(self.cache.layer_positions)
            positions = stream_positions(self.cache.layer_positions, streamed)
            if positions and args.memory_kind == MemoryKind.DRAM:
                self._streams = Streams(
                    self.prefill, self.cache, self.counters, positions, config.state_groups
                )
            self.inbox = _unpinned(lambda: SendInbox(self.options.manager.host, self._start_send))
            log.info(
                "kvbridge prefill rank %d (pipeline stage %d): %s engine, bootstrap %s, %s KV "
                "of %d buffers × %d pages (layers %s)",
                config.tp_rank,
                config.pp_rank,
                manager_config.engine,
                self.prefill.bootstrap_url,
                args.kv_layout.name,
                len(args.kv_buffers),
                args.num_pages,
                list(args.layer_ids),
            )
        if config.consumes:
            decode_config = self.options.manager_config(run_bootstrap=False, bootstrap_url=None)
            self.decode = _unpinned(lambda: DecodeManager(args, decode_config))
        for role, manager in (("prefill", self.prefill), ("decode", self.decode)):
            if manager is not None and manager.metrics.port is not None:
                log.info(
                    "kvbridge %s rank %d: Prometheus metrics on http://%s:%d/metrics",
                    role,
                    config.tp_rank,
                    self.options.manager.host,
                    manager.metrics.port,
                )

    def _start_send(self, send: SendSpec) -> None:
        """On the send inbox's thread, as the scheduler hands a send over: a streamed
        request's send takes its room over, failing it if the prompt did not end there."""
        if self.prefill is None or self.cache is None:
            return
        stream = self._streams.take(send.request_id) if self._streams is not None else None
        if stream is None and not send.aborted:
            self._sends.start(send, self.prefill, self.cache)
            return
        sender = stream.sender if stream is not None else None
        try:
            if sender is None:  # nothing streamed here: decode, if it asked, hears at once
                sender = self.prefill.sender(send.room)
            if send.aborted or stream is None or not stream.done:
                sender.abort(send.aborted or "the prefill request ended before its prompt")
        except Exception as exc:  # (a room that ended here already)
            log.warning("request %s: %r", send.request_id, exc)
        if stream is not None:
            stream.done = True
        self._sends.adopt(send.request_id, sender, sum(map(len, send.blocks)))
        self.prefill.activity.set()

    # --- prefill, decode first: the forward's layers ----------------------------------------

    def begin_step(self, streams: list[StreamSpec], aborts: Mapping[str, StreamAbort]) -> None:
        if self._streams is None:
            return
        for request_id, abort in aborts.items():
            self._streams.abort(request_id, abort)
        self._streams.begin(streams)  # (with none, it still ends a step that never ended)

    def layer_saved(self, name: str) -> None:
        if self._streams is not None:
            self._streams.layer_saved(name)

    def end_step(self) -> None:
        if self._streams is not None:
            self._streams.end()

    def start(self, step: StepMetadata) -> None:
        assert self.cache is not None or not step.loads
        for load in step.loads:
            self._loads.start(load, self.decode, self.cache, self.config.state_groups)
        if step.loads:
            log.debug(
                "step: %d load(s) started; %d in flight", len(step.loads), self._loads.in_flight
            )
        for request_id in step.aborts:
            self._loads.abort(request_id)
        for remote in step.releases:
            if self.decode is not None:  # tell prefill at once rather than at its deadline
                self._loads.release(remote, self.decode)
        if step.renewals and self.decode is not None:
            self._loads.renew(step.renewals, self.decode)
        self._loads.send_aborts()

    def finished(self, idle: bool) -> tuple[set[str] | None, set[str] | None]:
        if self.inbox is not None and not self.inbox.alive:  # sends would strand their blocks
            raise RuntimeError(self.inbox.failure or "kvbridge's send inbox stopped")
        # vLLM calls this once per step, after the forward (and start_load_kv): the time since
        # the last call is what a step that computed something costs.
        if not idle and self._last_step_ended is not None:
            self._step_times.record(time.monotonic() - self._last_step_ended)
        sent, loaded = self._poll()
        if idle:
            sent, loaded = self._wait_while_idle(sent, loaded)
        self._last_step_ended = time.monotonic()
        return sent or None, loaded or None

    def _wait_while_idle(self, sent: set[str], loaded: set[str]) -> tuple[set[str], set[str]]:
        """An engine step with nothing to compute while transfers are pending. With nothing
        ended, wait for one to end (at most idle_poll_s) rather than spin a core. Once loads
        ended, give the loads still in flight a short window to end as well: the requests
        then start computing in one step, where the late ones would otherwise wait a whole
        compute step behind the early ones."""
        activity = self._activity()
        if not sent and not loaded:
            activity.clear()  # cleared before polling: an end after the poll wakes the wait
            sent, loaded = self._poll()
            if not sent and not loaded:
                activity.wait(self.options.idle_poll_s)
                sent, loaded = self._poll()
        if not loaded:
            return sent, loaded
        # The window is decided afresh whenever loads end (what was waited is spent; what
        # counts is whether the ones still coming are worth more waiting), and never runs past
        # idle_batch_s from the first end.
        first_end = time.monotonic()
        latest = deadline = first_end + self.options.idle_batch_s
        more_loaded = loaded
        while self._loads.in_flight:
            now = time.monotonic()
            if more_loaded:
                window = self._step_times.batch_window(
                    self.options.idle_batch_s,
                    ended=len(loaded),
                    in_flight=self._loads.in_flight,
                    gap_s=(now - first_end) / (len(loaded) - 1) if len(loaded) > 1 else 0.0,
                )
                deadline = min(latest, now + window)
            if (remaining := deadline - now) <= 0:
                break
            activity.clear()
            more_sent, more_loaded = self._poll()
            sent |= more_sent
            loaded |= more_loaded
            if not more_sent and not more_loaded:
                activity.wait(remaining)
        log.debug(
            "idle step: %d load(s) ended, %d in flight, waited %.1f ms for them",
            len(loaded),
            self._loads.in_flight,
            1000 * (time.monotonic() - first_end),
        )
        return sent, loaded

    def _activity(self) -> threading.Event:
        """What signals that a pending transfer may have ended: decode's loads first (an idle
        step waits on them), else prefill's sends."""
        if self.decode is not None and (self._loads.pending or self.prefill is None):
            return self.decode.activity
        if self.prefill is not None:
            return self.prefill.activity
        return threading.Event()  # neither side: the wait is a sleep

    def _poll(self) -> tuple[set[str], set[str]]:
        """The requests whose send, and whose load, ended since the last poll."""
        return self._sends.poll(), self._loads.poll()

    def take_interval(self) -> dict[str, Any]:
        """What this worker saw since the last call (`vllm_stats`): the counters that moved,
        load durations, prefill's engine writes, failures by kind."""
        data: dict[str, Any] = self.counters.since(self._reported)
        self._reported = dataclasses.replace(self.counters)
        if self.prefill is not None:
            for seconds, nbytes in self.prefill.metrics.take_writes():
                self._interval.observe(WRITE_SECONDS, seconds)
                self._interval.observe(WRITE_BYTES, nbytes)
        data.update(self._interval.take())
        return data

    def take_load_errors(self) -> set[int]:
        """Blocks of failed loads (vLLM's report for one KV cache group)."""
        errors = self._loads.take_failed_blocks()
        if self.config.multi_group:
            return set()  # reported by request instead: take_failed_loads
        return errors

    def take_failed_loads(self) -> set[str]:
        failed = self._loads.take_failed_requests()
        return failed if self.config.multi_group else set()

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self._opener.shutdown(wait=True, cancel_futures=True)
        for manager in (self.decode, self.prefill):
            if manager is not None:
                manager.close()
        self.decode = self.prefill = None
