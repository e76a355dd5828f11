"""`kvbridge demo`: a bootstrap service, a prefill group and a decode group as separate
processes, moving the KV cache of N requests through a real engine, every byte verified.

Each request's KV content is a function of (room, buffer, page of the request, word), so the
decode side verifies what landed in its scattered pages without being told where prefill kept
them. Timing runs on decode, from the first request sent to the last room complete, after
every prefill rank has filled its pages.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.synchronize import Event
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs, TransferPlan, kv_heads_on_rank
from kvbridge.config import ManagerConfig
from kvbridge.wire import KVLayout, KVPoll

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
AUX_BYTES = 64


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_layout: KVLayout = KVLayout.MHA
    dtype: str = "bfloat16"

    def bytes_per_token(self, attn_tp_size: int = 1) -> int:
        heads = (
            self.kv_heads
            if self.kv_layout == KVLayout.MLA
            else kv_heads_on_rank(self.kv_heads, attn_tp_size)
        )
        per_layer = 2 if self.kv_layout == KVLayout.MHA else 1
        return self.layers * per_layer * heads * self.head_dim * 2


MODELS = {
    "llama3-8b": ModelShape("Llama-3-8B", 32, 8, 128),
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 8, 128),
    "llama3-70b": ModelShape("Llama-3-70B", 80, 8, 128),
    "deepseek-v3": ModelShape("DeepSeek-V3", 61, 1, 576, KVLayout.MLA),
}


@dataclass(frozen=True)
class DemoConfig:
    model: str = "llama3-8b"
    requests: int = 16
    tokens: int = 1024
    page_size: int = 16
    tp: int = 1
    engine: str = "nixl"
    chunks: int = 2
    timeout_s: float = 120.0
    # Decode's page pool as a multiple of what the requests need (pages are drawn scattered).
    decode_pool_factor: float = 1.25
    # After the kvbridge run, replay the identical blocks through the raw engine and time it.
    measure_raw: bool = False

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.tokens / self.page_size)

    def kv_bytes_per_rank(self) -> int:
        return (
            self.requests
            * self.pages_per_request
            * self.page_size
            * self.shape.bytes_per_token(self.tp)
        )


@dataclass
class DemoEvents:
    """Cross-process milestones: prefill filled its pages; decode verified; each side done."""

    filled: list[Event]
    verified: Event
    prefill_done: list[Event]
    decode_done: list[Event]


@dataclass
class RankReport:
    role: str
    rank: int
    ok: bool
    error: str | None = None
    transport: str = ""
    rooms: int = 0
    bytes: int = 0
    seconds: float = 0.0
    raw_bytes: int = 0
    raw_seconds: float = 0.0
    raw_blocks: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    mismatched_rooms: list[int] = field(default_factory=list)
    failed_rooms: dict[int, str] = field(default_factory=dict)


def page_content(room: int, buffer: int, pages: int, page_bytes: int) -> npt.NDArray[np.uint64]:
    """The bytes a request's pages hold in one buffer, [pages, page_bytes // 8] words."""
    words = page_bytes // 8
    base = np.uint64((room * 1_000_003 + buffer) * 0x100000001B3 % 2**64)
    index = np.arange(pages * words, dtype=np.uint64).reshape(pages, words)
    content: npt.NDArray[np.uint64] = (index + base) * GOLDEN
    return content


def allocate_rank(
    config: DemoConfig, rank: int, pool_pages: int
) -> tuple[list[np.ndarray], np.ndarray, KVArgs]:
    shape = config.shape
    heads = (
        shape.kv_heads
        if shape.kv_layout == KVLayout.MLA
        else kv_heads_on_rank(shape.kv_heads, config.tp)
    )
    per_layer = 2 if shape.kv_layout == KVLayout.MHA else 1
    kv = [
        np.empty((pool_pages, config.page_size, heads, shape.head_dim), dtype=np.uint16)
        for _ in range(per_layer * shape.layers)
    ]
    for array in kv:
        # Touch every page now, as a serving engine's preallocated pool is: otherwise the
        # first transfer into it pays the kernel's page faults and the demo measures those.
        array.fill(0)
    aux = np.zeros((config.requests, AUX_BYTES), dtype=np.uint8)
    args = KVArgs.from_numpy(
        kv,
        kv_layout=shape.kv_layout,
        total_kv_heads=shape.kv_heads,
        attn_tp_rank=rank,
        attn_tp_size=config.tp,
        aux=[aux],
    )
    return kv, aux, args


def _words(array: np.ndarray) -> np.ndarray:
    return array.reshape(array.shape[0], -1).view(np.uint64)


def run_prefill(
    config: DemoConfig, rank: int, bootstrap_url: str, events: DemoEvents, results: Any
) -> None:
    from kvbridge.prefill import PrefillManager

    report = RankReport("prefill", rank, ok=False)
    manager = None
    try:
        pages_per_request = config.pages_per_request
        kv, aux, args = allocate_rank(config, rank, config.requests * pages_per_request)
        manager_config = ManagerConfig(
            engine=config.engine, bootstrap_url=bootstrap_url, keep_plans=config.measure_raw
        )
        manager = PrefillManager(args, manager_config)
        report.transport = manager.engine.transport
        senders = []
        for room in range(config.requests):
            pages = np.arange(room * pages_per_request, (room + 1) * pages_per_request)
            for buffer, array in enumerate(kv):
                _words(array)[pages] = page_content(room, buffer, pages.size, args.page_bytes)
            aux[room] = np.frombuffer(np.uint64(room).tobytes() * (AUX_BYTES // 8), np.uint8)
            senders.append((room, pages))
        events.filled[rank].set()
        active = []
        for room, pages in senders:
            sender = manager.sender(room)
            for chunk_index, chunk in enumerate(np.array_split(pages, config.chunks)):
                last = chunk_index == config.chunks - 1
                sender.send(chunk, last=last, aux_index=room if last else None)
            active.append(sender)
        deadline = time.monotonic() + config.timeout_s
        while time.monotonic() < deadline:
            states = [sender.poll() for sender in active]
            if all(state in (KVPoll.Success, KVPoll.Failed) for state in states):
                break
            time.sleep(0.005)
        for sender in active:
            if sender.poll() != KVPoll.Success:
                report.failed_rooms[sender.room] = sender.failure_reason or str(sender.poll())
        report.rooms = len(active)
        report.ok = not report.failed_rooms
        if config.measure_raw and report.ok:
            _replay_raw(manager, config, events, report)
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        events.prefill_done[rank].set()
        results.put(asdict(report))
        if manager is not None:
            # Decode reads the last statuses (and its verification ends) before sockets go.
            events.decode_done[rank].wait(config.timeout_s)
            manager.close()


def _replay_raw(manager: Any, config: DemoConfig, events: DemoEvents, report: RankReport) -> None:
    """The identical blocks kvbridge wrote, through the engine alone, in one write, once
    decode has verified what kvbridge delivered (the replay rewrites the same bytes)."""
    events.verified.wait(config.timeout_s)
    by_peer: dict[str, list[TransferPlan]] = {}
    for peer, plan in manager.written_plans:
        by_peer.setdefault(peer, []).append(plan)
    started = time.perf_counter()
    handles = [
        manager.engine.write(peer, TransferPlan.concat(*plans)) for peer, plans in by_peer.items()
    ]
    for handle in handles:
        handle.wait(config.timeout_s)
    report.raw_seconds = time.perf_counter() - started
    report.raw_bytes = sum(plan.total_bytes for _, plan in manager.written_plans)
    report.raw_blocks = sum(len(plan) for _, plan in manager.written_plans)


def run_decode(
    config: DemoConfig, rank: int, bootstrap_url: str, events: DemoEvents, results: Any
) -> None:
    from kvbridge.decode import DecodeManager

    report = RankReport("decode", rank, ok=False)
    manager = None
    try:
        pages_per_request = config.pages_per_request
        pool = math.ceil(config.requests * pages_per_request * config.decode_pool_factor)
        kv, aux, args = allocate_rank(config, rank, pool)
        manager = DecodeManager(
            args, ManagerConfig(engine=config.engine, bootstrap_url=bootstrap_url)
        )
        report.transport = manager.engine.transport
        scattered = np.random.default_rng(rank).permutation(pool)
        for filled in events.filled:
            if not filled.wait(config.timeout_s):
                raise TimeoutError("the prefill group never filled its pages")
        receivers = [manager.receiver(room) for room in range(config.requests)]
        started = time.perf_counter()
        sent_at = {}
        for room, receiver in enumerate(receivers):
            pages = scattered[room * pages_per_request : (room + 1) * pages_per_request]
            sent_at[room] = time.perf_counter()
            receiver.init(pages, aux_index=room)
        done: dict[int, float] = {}
        deadline = time.monotonic() + config.timeout_s
        while len(done) < len(receivers) and time.monotonic() < deadline:
            for room, receiver in enumerate(receivers):
                if room not in done and receiver.poll() in (KVPoll.Success, KVPoll.Failed):
                    done[room] = time.perf_counter()
                    results.put({"progress": room})
            time.sleep(0.0005)
        report.seconds = max(done.values(), default=started) - started
        for room, receiver in enumerate(receivers):
            if receiver.poll() != KVPoll.Success:
                report.failed_rooms[room] = receiver.failure_reason or f"state {receiver.poll()}"
                continue
            report.latencies_ms.append((done[room] - sent_at[room]) * 1e3)
            pages = scattered[room * pages_per_request : (room + 1) * pages_per_request]
            same = all(
                np.array_equal(
                    _words(array)[pages],
                    page_content(room, buffer, pages.size, args.page_bytes),
                )
                for buffer, array in enumerate(kv)
            )
            same &= bool((aux[room].view(np.uint64) == room).all())
            if not same:
                report.mismatched_rooms.append(room)
            report.bytes += pages.size * args.page_bytes * len(kv) + AUX_BYTES
        report.rooms = len(receivers)
        report.ok = not report.failed_rooms and not report.mismatched_rooms
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        events.verified.set()
        results.put(asdict(report))
        if manager is not None:
            # Stay reachable while prefill replays the blocks (the target drives NIXL too).
            events.prefill_done[rank].wait(config.timeout_s)
            manager.close()
        events.decode_done[rank].set()


@dataclass
class DemoResult:
    config: DemoConfig
    reports: list[RankReport]

    @property
    def ok(self) -> bool:
        return len(self.reports) == 2 * self.config.tp and all(r.ok for r in self.reports)

    @property
    def decode_reports(self) -> list[RankReport]:
        return [r for r in self.reports if r.role == "decode"]

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.decode_reports)

    @property
    def gbps(self) -> float:
        seconds = max((r.seconds for r in self.decode_reports), default=0.0)
        return self.total_bytes / seconds / 1e9 if seconds else 0.0

    @property
    def raw_gbps(self) -> float:
        prefill = [r for r in self.reports if r.role == "prefill"]
        seconds = max((r.raw_seconds for r in prefill), default=0.0)
        return sum(r.raw_bytes for r in prefill) / seconds / 1e9 if seconds else 0.0

    def latency_ms(self, quantile: float) -> float:
        values = [v for r in self.decode_reports for v in r.latencies_ms]
        return float(np.quantile(values, quantile)) if values else float("nan")


def run_demo(config: DemoConfig, on_progress: Any = None) -> DemoResult:
    """Run the whole demo; `on_progress(rooms_done)` is called as decode completes rooms."""
    from kvbridge.control.bootstrap import BootstrapServer

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    events = DemoEvents(
        filled=[context.Event() for _ in range(config.tp)],
        verified=context.Event(),
        prefill_done=[context.Event() for _ in range(config.tp)],
        decode_done=[context.Event() for _ in range(config.tp)],
    )
    bootstrap = BootstrapServer().start()
    processes = [
        context.Process(
            target=target,
            args=(config, rank, bootstrap.url, events, results),
            name=f"kvbridge-{role}-{rank}",
        )
        for role, target in (("prefill", run_prefill), ("decode", run_decode))
        for rank in range(config.tp)
    ]
    for process in processes:
        process.start()
    reports: list[RankReport] = []
    progressed = 0
    deadline = time.monotonic() + config.timeout_s + 60
    try:
        while len(reports) < len(processes) and time.monotonic() < deadline:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                if not any(process.is_alive() for process in processes):
                    break
                continue
            if "progress" in item:
                progressed += 1
                if on_progress is not None:
                    on_progress(progressed)
            else:
                reports.append(RankReport(**item))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        bootstrap.close()
    reported = {f"kvbridge-{r.role}-{r.rank}" for r in reports}
    for process in processes:
        if process.name not in reported:  # died before it could report (a crash, a kill)
            role, rank = process.name.split("-")[1:]
            error = f"exited with {process.exitcode} before reporting"
            reports.append(RankReport(role, int(rank), ok=False, error=error))
    return DemoResult(config, reports)
