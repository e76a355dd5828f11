"""kvbridge as a vLLM KV connector, loaded without patching vLLM:

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both"}'

The flow is vLLM's PD flow: a prefill request carries ``kv_transfer_params:
{"do_remote_decode": true}``; the ``kv_transfer_params`` of its output, passed with the decode
request, make the decode instance load the KV and go on generating. Transfers are kvbridge's
push: decode asks for the pages it lacks (a TransferRequest naming its blocks), the prefill
instance writes them and says so; prefill keeps a finished request's blocks until decode has
them, aborted, or `request_timeout_s` passed.

vLLM makes one connector object per role. The scheduler side only keeps books (which requests
send, load, or were aborted) and hands them to the workers in each step's metadata; the
worker side owns kvbridge's managers (engine, control channel, bootstrap service) and reports
finished transfers back through `get_finished`. The pure part is `vllm_core`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from kvbridge.decode import DecodeManager, KVReceiver
from kvbridge.integrations.vllm_core import (
    ConnectorCounters,
    ConnectorOptions,
    LoadSpec,
    OptionsError,
    RemotePrefill,
    SendSpec,
    StepMetadata,
    StepTimes,
    check_vllm_version,
    cpu_list,
    kv_args_from_vllm,
    pages_to_load,
    pages_to_send,
    tokens_to_load,
)
from kvbridge.prefill import KVSender, PrefillManager
from kvbridge.wire.messages import KVPoll

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvbridge.vllm")
T = TypeVar("T")


def _log_through_vllm() -> None:
    """kvbridge's records in vLLM's log, through vLLM's handlers (its format, stream and
    level), unless the application set up kvbridge's logging itself. Without this they go
    nowhere in vLLM's engine and worker processes."""
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    configured = [h for h in ours.handlers if not isinstance(h, logging.NullHandler)]
    if configured or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


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


class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's `StepMetadata`, in the class vLLM expects."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """From the prefill workers to their scheduler: where decode finds this instance."""

    bootstrap_url: str


@dataclass
class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters over one interval, for vLLM's "KV Transfer metrics" log line
    (summed over workers); kvbridge's own Prometheus metrics go further (`metrics_port`)."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVBridgeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        check_vllm_version(vllm.__version__)
        _log_through_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        self.engine_id = str(transfer.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.produces = bool(transfer.is_kv_producer)
        self.consumes = bool(transfer.is_kv_consumer)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: _SchedulerSide | None = _SchedulerSide(self)
            self._worker: _WorkerSide | None = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, vllm_config)

    # --- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        url = self._worker_side.bootstrap_url
        return KVBridgeHandshake(url) if url is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side.start(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its KV is in place

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # prefill writes finished requests' blocks when decode asks for them

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        metadata = self._step_metadata() if self.has_connector_metadata() else StepMetadata()
        return self._worker_side.finished(metadata.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def counters(self) -> ConnectorCounters:
        """This worker's transfer counters."""
        return self._worker_side.counters

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        if self._worker is None:  # the scheduler asks too; its side moves nothing
            return None
        changed = self._worker.take_interval()
        return KVBridgeStats(data=changed) if changed else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    # --- scheduler side --------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        handshake = metadata.get(0)
        if isinstance(handshake, KVBridgeHandshake):
            self._scheduler_side.bootstrap_url = handshake.bootstrap_url

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        idle = int(scheduler_output.total_num_scheduled_tokens) == 0
        return KVBridgeMetadata(self._scheduler_side.take_step(idle))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side.on_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # Keeps a prefill engine stepping while decode instances still have blocks to fetch,
        # so that get_finished frees them when they are done.
        return self._scheduler is not None and self._scheduler.pending

    # --- plumbing --------------------------------------------------------------------------

    def _step_metadata(self) -> StepMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVBridgeMetadata)
        return metadata.step

    @property
    def _worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side hook was called on the scheduler's connector")
        return self._worker

    @property
    def _scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on a worker's connector")
        return self._scheduler


class _SchedulerSide:
    """Book-keeping only: which requests send, load or were given up, handed to the workers
    in the next step's metadata."""

    def __init__(self, connector: KVBridgeConnector) -> None:
        self.connector = connector
        self.bootstrap_url: str | None = None
        self._step = StepMetadata()
        self._computed: dict[str, int] = {}  # decode request → tokens in the local prefix
        self._sending: set[str] = set()
        self._loading: set[str] = set()
        self._refused: set[str] = set()  # requests whose parameters were malformed (logged)

    @property
    def pending(self) -> bool:
        return bool(self._sending or self._loading)

    def _remote(self, request: Any) -> RemotePrefill | None:
        """The remote prefill a request names; None for none, or for malformed parameters
        (a client's input: the request is then computed here, the engine goes on)."""
        try:
            return RemotePrefill.from_params(request.kv_transfer_params)
        except OptionsError as exc:
            if request.request_id not in self._refused:
                self._refused.add(request.request_id)
                log.warning("request %s: computed locally: %s", request.request_id, exc)
            return None

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        remote = self._remote(request)
        if remote is None or not params.get("do_remote_prefill"):
            return 0, False
        count = tokens_to_load(remote, request.num_prompt_tokens, num_computed)
        self._computed[request.request_id] = num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        remote = self._remote(request)
        if remote is None or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        prefix = self._computed.pop(request.request_id, 0)
        if num_external_tokens == 0:  # every token is in the local prefix cache
            self._step.releases.append(remote)
            return
        block_ids = blocks.get_block_ids()[0]
        try:
            load = LoadSpec(
                request.request_id, remote,
                pages_to_load(block_ids, self.connector.block_size, prefix, num_external_tokens),
                prefix,
            )  # fmt: skip
        except ValueError as exc:  # vLLM allocated otherwise than counted: a failed load
            load = LoadSpec(request.request_id, remote, tuple(block_ids), prefix, str(exc))
        self._step.loads.append(load)
        self._loading.add(request.request_id)

    def finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        request_id = request.request_id
        self._computed.pop(request_id, None)
        if request_id in self._loading:
            # Ended while its load is in flight (the client went away): the blocks stay until
            # no prefill write can land in them.
            self._step.aborts.append(request_id)
            return True, None
        remote = self._remote(request)
        self._refused.discard(request_id)
        if remote is not None and params.get("do_remote_prefill"):
            self._step.releases.append(remote)  # ended before it was scheduled
            return False, None
        if not params.get("do_remote_decode") or not self.connector.produces:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        if self.bootstrap_url is None:
            log.error("request %s: no bootstrap service on this instance", request_id)
            return False, None
        pages = pages_to_send(block_ids, self.connector.block_size, request.num_computed_tokens)
        if not pages:
            return False, None
        room = secrets.randbits(63)
        self._step.sends.append(SendSpec(request_id, room, pages))
        self._sending.add(request_id)
        remote = RemotePrefill(
            self.bootstrap_url, room, request.num_computed_tokens, self.connector.engine_id,
            request_id,
        )  # fmt: skip
        return True, remote.to_params()

    def take_step(self, idle: bool) -> StepMetadata:
        step, self._step = self._step, StepMetadata()
        step.idle = idle and self.pending
        return step

    def on_output(self, output: Any) -> None:
        self._sending.difference_update(output.finished_sending or ())
        self._loading.difference_update(output.finished_recving or ())


@dataclass
class _Room:
    """A decode-side room being opened off the engine's step (the first room toward a prefill
    instance looks its bootstrap service up, which may take up to bootstrap_timeout_s), then
    in flight. `pages` are empty for a release (decode tells prefill it needs nothing)."""

    opening: Future[KVReceiver]
    pages: tuple[int, ...] = ()
    aborted: bool = False
    abort_sent: bool = False

    def receiver(self) -> KVReceiver | None:
        """The receiver once opened; None while opening (or if opening raised)."""
        if not self.opening.done() or self.opening.exception() is not None:
            return None
        return self.opening.result()


class _WorkerSide:
    """kvbridge's managers for this worker's KV caches, and the rooms in flight."""

    def __init__(self, connector: KVBridgeConnector, vllm_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.connector = connector
        self.options = connector.options
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.total_kv_heads = int(
            vllm_config.model_config.get_total_num_kv_heads()
        )  # fmt: skip
        self.prefill: PrefillManager | None = None
        self.decode: DecodeManager | None = None
        self._sends: dict[str, KVSender] = {}
        self._unsendable: set[str] = set()
        self._pages_of_send: dict[str, int] = {}
        self._loads: dict[str, _Room] = {}
        self._releases: list[_Room] = []
        self._opener = ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kvbridge-vllm-open", initializer=_unpin
        )
        self._load_errors: set[int] = set()
        self._last_step_ended: float | None = None  # when get_finished last returned
        self._step_times = StepTimes()
        self.counters = ConnectorCounters()
        self._reported = ConnectorCounters()  # as of the last get_kv_connector_stats

    @property
    def bootstrap_url(self) -> str | None:
        if self.prefill is None or self.tp_rank != 0:
            return None
        return self.prefill.bootstrap_url

    def register(self, kv_caches: dict[str, Any]) -> None:
        args = kv_args_from_vllm(
            kv_caches, total_kv_heads=self.total_kv_heads, attn_tp_rank=self.tp_rank,
            attn_tp_size=self.tp_size,
        )  # fmt: skip
        if self.connector.produces:
            if self.tp_size > 1 and self.options.bootstrap_port == 0:
                raise RuntimeError(
                    "kvbridge with TP > 1 on a prefill instance needs "
                    "kv_connector_extra_config.bootstrap_port: every rank registers there"
                )
            url = f"http://{self.options.host}:{self.options.bootstrap_port}"
            config = self.options.manager_config(
                run_bootstrap=self.tp_rank == 0, bootstrap_url=None if self.tp_rank == 0 else url
            )
            self.prefill = _unpinned(lambda: PrefillManager(args, config))
            log.info(
                "kvbridge prefill rank %d: %s engine, bootstrap %s, %d layers of %d pages",
                self.tp_rank, config.engine, self.prefill.bootstrap_url, len(args.layer_ids),
                args.num_pages,
            )  # fmt: skip
        if self.connector.consumes:
            decode_config = self.options.manager_config(run_bootstrap=False, bootstrap_url=None)
            self.decode = _unpinned(lambda: DecodeManager(args, decode_config))
        for role, manager in (("prefill", self.prefill), ("decode", self.decode)):
            if manager is not None and manager.metrics.port is not None:
                log.info("kvbridge %s rank %d: Prometheus metrics on http://%s:%d/metrics",
                         role, self.tp_rank, self.options.host, manager.metrics.port)  # fmt: skip

    def start(self, step: StepMetadata) -> None:
        for send in step.sends:
            if self.prefill is None:
                continue
            try:
                sender = self.prefill.sender(send.room)
            except ValueError as exc:  # the room id ended here before: free the blocks
                log.error("request %s: not sent: %s", send.request_id, exc)
                self._unsendable.add(send.request_id)
                continue
            sender.send(list(send.pages), last=True)
            self._sends[send.request_id] = sender
            self._pages_of_send[send.request_id] = len(send.pages)
        for load in step.loads:
            self._start_load(load)
        if step.sends or step.loads:
            log.debug("step: %d send(s), %d load(s) started; %d load(s) in flight",
                      len(step.sends), len(step.loads), len(self._loads))  # fmt: skip
        for request_id in step.aborts:
            ongoing = self._loads.get(request_id)
            if ongoing is not None:
                ongoing.aborted = True
        for remote in step.releases:
            if self.decode is not None:  # tell prefill at once rather than at its deadline
                self._releases.append(_Room(self._opening(remote), aborted=True))
        for room in (*self._loads.values(), *self._releases):
            self._send_abort(room)

    def _open(self, remote: RemotePrefill, load: LoadSpec | None = None) -> KVReceiver:
        """Runs on the opener pool: look the prefill instance up, send the request."""
        assert self.decode is not None
        receiver = self.decode.receiver(remote.room, remote.bootstrap_url)
        if load is not None:
            receiver.init(list(load.pages), decode_prefix_len=load.prefix_tokens)
        return receiver

    def _opening(self, remote: RemotePrefill, load: LoadSpec | None = None) -> Future[KVReceiver]:
        """The room opened here when its prefill instance is known (no blocking lookup: a
        hop to the pool would only add thread hand-offs), else on the pool."""
        assert self.decode is not None
        if not self.decode.knows_prefill(remote.bootstrap_url):
            return self._opener.submit(self._open, remote, load)
        opened: Future[KVReceiver] = Future()
        try:
            opened.set_result(self._open(remote, load))
        except Exception as exc:  # the load's failure, as from the pool
            opened.set_exception(exc)
        return opened

    def _start_load(self, load: LoadSpec) -> None:
        if self.decode is None or load.error is not None:
            opening: Future[KVReceiver] = Future()  # fails at once: the blocks count as failed
            opening.set_exception(
                RuntimeError(load.error or "this instance's kv_role does not consume KV")
            )
        else:
            opening = self._opening(load.remote, load)
        self._loads[load.request_id] = _Room(opening, load.pages)

    def _send_abort(self, room: _Room) -> None:
        receiver = room.receiver()
        if room.aborted and not room.abort_sent and receiver is not None:
            room.abort_sent = True
            reason = "the request ended on decode" if room.pages else "decode needs no block"
            receiver.abort(reason)

    def finished(self, idle: bool) -> tuple[set[str] | None, set[str] | None]:
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
        while self._loads:
            now = time.monotonic()
            if more_loaded:
                window = self._step_times.batch_window(
                    self.options.idle_batch_s, ended=len(loaded), in_flight=len(self._loads),
                    gap_s=(now - first_end) / (len(loaded) - 1) if len(loaded) > 1 else 0.0,
                )  # fmt: skip
                deadline = min(latest, now + window)
            if (remaining := deadline - now) <= 0:
                break
            activity.clear()
            more_sent, more_loaded = self._poll()
            sent |= more_sent
            loaded |= more_loaded
            if not more_sent and not more_loaded:
                activity.wait(remaining)
        log.debug("idle step: %d load(s) ended, %d in flight, waited %.1f ms for them",
                  len(loaded), len(self._loads),
                  1000 * (time.monotonic() - first_end))  # fmt: skip
        return sent, loaded

    def _activity(self) -> threading.Event:
        """What signals that a pending transfer may have ended: decode's loads first (an idle
        step waits on them), else prefill's sends."""
        if self.decode is not None and (self._loads or self._releases or self.prefill is None):
            return self.decode.activity
        if self.prefill is not None:
            return self.prefill.activity
        return threading.Event()  # neither side: the wait is a sleep

    def _poll(self) -> tuple[set[str], set[str]]:
        sent, self._unsendable = self._unsendable, set()
        self.counters.sends_failed += len(sent)
        for request_id, sender in list(self._sends.items()):
            if sender.pages_free:
                pages = self._pages_of_send.pop(request_id, 0)
                if sender.poll() == KVPoll.Failed:
                    log.warning("request %s: not sent: %s [%s]", request_id,
                                sender.failure_reason, sender.failure_kind)  # fmt: skip
                    self.counters.sends_failed += 1
                else:
                    self.counters.requests_sent += 1
                    self.counters.pages_sent += pages
                sender.clear()
                del self._sends[request_id]
                sent.add(request_id)
        loaded = set()
        for request_id, load in list(self._loads.items()):
            if self._load_done(request_id, load):
                del self._loads[request_id]
                loaded.add(request_id)
        for release in list(self._releases):
            self._send_abort(release)
            receiver = release.receiver()
            if release.opening.done() and (receiver is None or receiver.pages_safe):
                if receiver is not None:
                    receiver.clear()
                self._releases.remove(release)
                self.counters.rooms_released += 1
        return sent, loaded

    def _load_done(self, request_id: str, load: _Room) -> bool:
        """Whether the load ended and its pages are safe; counts and logs how it ended."""
        if not load.opening.done():
            return False
        self._send_abort(load)
        receiver = load.receiver()
        if receiver is None:  # opening raised: nothing was sent
            reason: str | None = repr(load.opening.exception())
        else:
            poll = receiver.poll()
            if poll == KVPoll.Success:
                receiver.clear()
                self.counters.requests_loaded += 1
                self.counters.pages_loaded += len(load.pages)
                return True
            if poll != KVPoll.Failed or not receiver.pages_safe:
                return False
            reason = f"{receiver.failure_reason} [{receiver.failure_kind}]"
            receiver.clear()
        if load.aborted:
            self.counters.loads_aborted += 1
        else:
            log.warning("request %s: KV load failed: %s", request_id, reason)
            self._load_errors.update(load.pages)
            self.counters.loads_failed += 1
        return True

    def take_interval(self) -> dict[str, int]:
        """The counters that moved since the last call."""
        changed = self.counters.since(self._reported)
        self._reported = dataclasses.replace(self.counters)
        return changed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self._opener.shutdown(wait=True, cancel_futures=True)
        for manager in (self.decode, self.prefill):
            if manager is not None:
                manager.close()
        self.decode = self.prefill = None
