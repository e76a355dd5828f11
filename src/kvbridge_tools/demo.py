"""`kvbridge demo`: a bootstrap service, a prefill group and a decode group as separate
processes, moving the KV cache of N requests through a real engine, every byte verified.

Each request's KV content is a function of (room, buffer, page of the request, word), so the
decode side verifies what landed in its scattered pages without being told where prefill kept
them. Timing runs on decode, from the first request sent to the last room complete, after
every prefill rank has filled its pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.synchronize import Barrier, Event
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs, TransferPlan, kv_heads_on_rank
from kvbridge.cache.topology import HeadRange, TopologyError, rank_heads, topology
from kvbridge.config import DEFAULT_STAGING_BYTES, ManagerConfig
from kvbridge.engines import EngineError, engine_spec
from kvbridge.logs import configure as configure_logging
from kvbridge.wire import KVLayout, KVPoll

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
AUX_BYTES = 64
# A per-request recurrent state (hybrid models), sharded by rows over attention TP.
STATE_ROWS, STATE_ROW_BYTES = 8, 32


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
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 4, 128),  # GQA with few KV heads
    "llama3-70b": ModelShape("Llama-3-70B", 80, 8, 128),
    "deepseek-v3": ModelShape("DeepSeek-V3", 61, 1, 576, KVLayout.MLA),
}


# A rank process's own memory beyond its KV (interpreter, numpy, the engine), about.
PROCESS_BYTES = 256 << 20


class DemoConfigError(ValueError):
    """A demo run that cannot work on this machine; the message says why."""


def available_memory() -> int:
    """Bytes of memory this machine has available now (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 16 << 30


@dataclass(frozen=True)
class DemoConfig:
    model: str = "llama3-8b"
    requests: int = 16
    tokens: int = 1024
    page_size: int = 16
    prefill_tp: int = 1
    decode_tp: int = 1
    # Decode context parallelism: each decode TP rank is `dcp` processes, token i on i % dcp.
    dcp: int = 1
    # The managers' settings (the engine and its options, staging, timeouts): each rank runs
    # with these, its own host and the group's bootstrap URL (`manager_config`).
    transfer: ManagerConfig = field(default_factory=ManagerConfig)
    chunks: int = 2
    timeout_s: float = 120.0
    # Decode's page pool as a multiple of what the requests need (pages are drawn scattered).
    decode_pool_factor: float = 1.25
    # After the kvbridge run, replay the identical blocks through the raw engine and time it.
    measure_raw: bool = False
    # kvbridge's log level in the rank processes (logging.WARNING: problems only).
    log_level: int = 30
    # Where the KV cache lives: "host" (numpy arrays), "torch-cpu" (torch tensors sharing
    # that memory: from_torch and torch staging kernels), "cuda" (torch tensors on the GPU).
    memory: str = "host"
    # A warm-up batch goes first, untimed: every request once more, under other room ids, into
    # the same pages of both sides (verified, then decode's are zeroed again). The engine's
    # connections are made, its first transfer's set-up paid and every destination page
    # written through it once before the timed batch, as in a serving deployment that has
    # run for a while (what benchmarks measure). With `measure_raw`, the raw replays run on
    # the warm-up's blocks, identical to the timed batch's, before it as well as after it.
    warmup: bool = False
    # The addresses the groups bind and advertise (the bootstrap service runs on prefill's),
    # and a network namespace the decode ranks move into: prefill and decode as two hosts
    # (`kvbridge_tools.netns`; the caller runs the demo inside prefill's namespace).
    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    decode_netns: str | None = None
    # A stand-in for a serving engine's scheduler thread that never waits: a pure-Python busy
    # loop in every prefill rank's process, from before the first batch to the end
    # (`benchmarks/busy_host.py`); and that process's `sys.setswitchinterval` (None: Python's
    # own, 5 ms), how long a thread that gave up the GIL may wait to take it back.
    prefill_busy_loop: bool = False
    prefill_switch_interval_s: float | None = None
    # Cross-layer KV (as vLLM's block-outermost layouts): every buffer's page of a block side
    # by side in one allocation, registered as one buffer of whole blocks, so that a run of
    # pages is one descriptor for every layer. Equal TP, no DCP, host memory.
    cross_layer: bool = False

    @property
    def shape(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def engine(self) -> str:
        return self.transfer.engine

    def manager_config(self, bootstrap_url: str, host: str) -> ManagerConfig:
        """Either side's manager settings. Torch memory gets torch staging kernels: forced on
        CPU tensors, chosen by `auto` on a GPU."""
        kernels = "torch" if self.memory == "torch-cpu" else self.transfer.staging_kernels
        return replace(
            self.transfer, host=host, bootstrap_url=bootstrap_url, staging_kernels=kernels
        )

    @property
    def with_state(self) -> bool:
        """Requests carry a recurrent state too (MHA shapes whose state rows divide over
        both groups' TP sizes)."""
        return (
            self.shape.kv_layout == KVLayout.MHA
            and STATE_ROWS % self.prefill_tp == 0
            and STATE_ROWS % self.decode_tp == 0
        )

    @property
    def decode_ranks(self) -> int:
        return self.decode_tp * self.dcp

    def local_tokens(self, dcp_rank: int) -> int:
        """Tokens of a request that a DCP rank holds."""
        return len(range(dcp_rank, self.tokens, self.dcp))

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.tokens / self.page_size)

    @property
    def rooms(self) -> int:
        """Rooms in all: the timed requests (ids from 0), then the warm-up batch's if any."""
        return self.requests * (2 if self.warmup else 1)

    def slot(self, room: int) -> int:
        """The request whose pages, aux slot, state slot and content a room uses: a warm-up
        room uses those of the timed request it repeats."""
        return room % self.requests

    def kv_bytes_per_rank(self, tp: int) -> int:
        """KV bytes the requests occupy on one rank of a group of attention-TP `tp`."""
        return self.requests * self.tokens * self.shape.bytes_per_token(tp)

    def memory_needed(self) -> int:
        """Bytes of host memory the run takes, about: both groups' KV (decode's pool with its
        slack), the staging buffers where chunks are gathered, each process's own."""
        prefill = self.prefill_tp * self.kv_bytes_per_rank(self.prefill_tp)
        decode = self.decode_tp * self.kv_bytes_per_rank(self.decode_tp) * self.decode_pool_factor
        processes = self.prefill_tp + self.decode_ranks
        gathered = self.prefill_tp != self.decode_tp or self.transfer.write_path == "coalesced"
        staging = 2 * DEFAULT_STAGING_BYTES * processes if gathered else 0
        return int(prefill + decode + staging + PROCESS_BYTES * processes)

    def check(self) -> None:
        """Refuse, at once and in words, a run that cannot work here (`DemoConfigError`)."""
        shape = self.shape
        try:
            engine_spec(self.engine).resolve(dict(self.transfer.engine_options))
        except EngineError as exc:
            raise DemoConfigError(f"--engine-option for {self.engine}: {exc.detail}") from None
        try:
            topology(self.prefill_tp, self.decode_tp, shape.kv_heads, shape.kv_layout)
        except TopologyError as exc:
            raise DemoConfigError(
                f"TP {self.prefill_tp}→{self.decode_tp} cannot move {shape.name}'s "
                f"{shape.kv_heads} KV heads: {exc}"
            ) from None
        if self.memory == "cuda":
            try:
                import torch  # type: ignore[import-not-found,unused-ignore]
            except ImportError:
                raise DemoConfigError("--memory cuda needs torch, which is not installed") from None
            if not torch.cuda.is_available():
                raise DemoConfigError("--memory cuda needs a CUDA GPU; torch sees none here")
        if self.cross_layer and (
            self.prefill_tp != self.decode_tp or self.dcp != 1 or self.memory != "host"
        ):
            raise DemoConfigError(
                "--cross-layer moves whole blocks of every layer: it needs equal TP sizes, no "
                f"DCP and host memory (TP {self.prefill_tp}→{self.decode_tp}, DCP {self.dcp}, "
                f"{self.memory} memory)"
            )
        if self.prefill_switch_interval_s is not None and self.prefill_switch_interval_s <= 0:
            raise DemoConfigError(
                "the prefill switch interval must be a positive number of "
                f"seconds, not {self.prefill_switch_interval_s}"
            )
        needed, available = self.memory_needed(), available_memory()
        if needed > available:
            raise DemoConfigError(
                f"the run needs about {needed / 2**30:.1f} GiB of memory and "
                f"{available / 2**30:.1f} GiB is available: ask for fewer --requests or --tokens"
            )


@dataclass
class DemoEvents:
    """Cross-process milestones, one event per rank: prefill filled its pages; decode
    verified the warm-up batch and zeroed its pages again (`warmed`); prefill replayed the
    warm-up's blocks through the raw engine (`replayed`); decode verified the timed batch;
    each rank finished (the other side waits for all of them before closing its sockets).
    The prefill ranks start each raw replay together (`raw_start`), the decode ranks their
    timed batch (`timed_start`: none times its batch while another still verifies or zeroes
    its pages after the warm-up, on the same CPUs)."""

    filled: list[Event]
    warmed: list[Event]
    replayed: list[Event]
    verified: list[Event]
    prefill_done: list[Event]
    decode_done: list[Event]
    raw_start: Barrier
    timed_start: Barrier


def wait_all(events: list[Event], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    return all(event.wait(max(0.0, deadline - time.monotonic())) for event in events)


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
    raw_blocks: int = 0
    # Seconds of each way of replaying the blocks through the raw engine (`RAW_STRATEGIES`),
    # after the timed batch, and (with a warm-up batch) before it.
    raw_seconds: dict[str, float] = field(default_factory=dict)
    raw_seconds_before: dict[str, float] = field(default_factory=dict)
    # time.monotonic() (one clock for every process of the host) when a decode rank was done
    # with the warm-up batch (verified, pages zeroed again) and when it began its timed batch.
    warmup_done_at: float = 0.0
    timed_started_at: float = 0.0
    staged_chunks: int = 0
    staging_fallbacks: int = 0
    # Prefill: chunk writes by "path (reason)" (`PrefillStats.chunks_written`).
    chunk_paths: dict[str, int] = field(default_factory=dict)
    blocks_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    mismatched_rooms: list[int] = field(default_factory=list)
    failed_rooms: dict[int, str] = field(default_factory=dict)


def kv_content(
    room: int, buffer: int, tokens: int, heads: HeadRange, total_heads: int, head_words: int
) -> npt.NDArray[np.uint64]:
    """What a request's tokens hold in one buffer for some heads: [tokens, heads, words],
    each 8-byte word a function of (room, buffer, token, global head, word). Any rank can
    produce or check its part, whatever the TP sizes."""
    base = np.uint64((room * 1_000_003 + buffer) * 0x100000001B3 % 2**64)
    token = np.arange(tokens, dtype=np.uint64)[:, None, None]
    head = np.arange(heads.start, heads.stop, dtype=np.uint64)[None, :, None]
    word = np.arange(head_words, dtype=np.uint64)[None, None, :]
    index = (token * np.uint64(total_heads) + head) * np.uint64(head_words) + word
    content: npt.NDArray[np.uint64] = (index + base) * GOLDEN
    return content


def rank_head_range(config: DemoConfig, rank: int, tp: int) -> HeadRange:
    if config.shape.kv_layout == KVLayout.MLA:
        return HeadRange(0, config.shape.kv_heads)
    return rank_heads(rank, tp, config.shape.kv_heads)


MEMORY_KINDS = ("host", "torch-cpu", "cuda")


@dataclass
class RankMemory:
    """A rank's KV pages, aux and state slots as host numpy arrays (what the demo fills and
    verifies), the `KVArgs` kvbridge is given, and for GPU memory the device tensors the
    arrays are copied to and from around the transfer."""

    kv: list[npt.NDArray[Any]]
    aux: npt.NDArray[Any]
    state: npt.NDArray[Any] | None
    args: KVArgs
    device_tensors: list[Any] = field(default_factory=list)

    @property
    def host_arrays(self) -> list[npt.NDArray[Any]]:
        return [*self.kv, self.aux, *([self.state] if self.state is not None else [])]

    def to_device(self) -> None:
        if not self.device_tensors:  # host memory, or torch tensors sharing it
            return
        import torch  # type: ignore[import-not-found,unused-ignore]

        for host, device in zip(self.host_arrays, self.device_tensors, strict=True):
            device.view(torch.uint8).copy_(torch.from_numpy(host.view(np.uint8)))
        torch.cuda.synchronize()

    def holds_data(self, pages: Sequence[int]) -> bool:
        """Whether any byte of these KV pages (one per request catches a batch written
        early), of the aux or of the state slots is not zero, where the engine writes them
        (on the device for GPU memory)."""
        arrays: list[Any] = self.host_arrays
        if self.device_tensors:
            import torch  # type: ignore[import-not-found,unused-ignore]

            arrays = [tensor.view(torch.uint8) for tensor in self.device_tensors]
        index = list(pages)
        kv, slots = arrays[: len(self.kv)], arrays[len(self.kv) :]
        return any(bool(array[index].any()) for array in kv) or any(
            bool(array.any()) for array in slots
        )

    def to_host(self) -> None:
        if not self.device_tensors:
            return
        import torch  # type: ignore[import-not-found,unused-ignore]

        for host, device in zip(self.host_arrays, self.device_tensors, strict=True):
            host.view(np.uint8)[...] = device.view(torch.uint8).cpu().numpy()


def allocate_rank(config: DemoConfig, rank: int, tp: int, pool_pages: int) -> RankMemory:
    """KV pages, aux slots and (MHA models, TP dividing the state rows) state slots."""
    shape = config.shape
    heads = rank_head_range(config, rank, tp).count
    per_layer = 2 if shape.kv_layout == KVLayout.MHA else 1
    page, buffers = (config.page_size, heads, shape.head_dim), per_layer * shape.layers
    # Cross-layer: each buffer a view of one allocation, its pages a block of every buffer's.
    backing = np.empty((pool_pages if config.cross_layer else 0, buffers, *page), np.uint16)
    kv: list[npt.NDArray[Any]] = (
        [backing[:, buffer] for buffer in range(buffers)]
        if config.cross_layer
        else [np.empty((pool_pages, *page), dtype=np.uint16) for _ in range(buffers)]
    )
    for array in kv:
        # Touch every page now, as a serving engine's preallocated pool is: otherwise the
        # first transfer into it pays the kernel's page faults and the demo measures those.
        array.fill(0)
    aux = np.zeros((config.requests, AUX_BYTES), dtype=np.uint8)
    state = None
    if config.with_state:
        state = np.zeros((config.requests, STATE_ROWS // tp, STATE_ROW_BYTES), dtype=np.uint8)
    geometry: dict[str, Any] = dict(
        kv_layout=shape.kv_layout,
        total_kv_heads=shape.kv_heads,
        attn_tp_rank=rank,
        attn_tp_size=tp,
        state_dims=[STATE_ROWS // tp] if state is not None else [],
    )
    if config.cross_layer:  # one buffer of opaque pages, a block of every buffer each
        blocks = backing.view(np.uint8).reshape(pool_pages, 1, 1, -1)
        geometry.update(kv_layout=KVLayout.PAGES, total_kv_heads=1, layer_ids=[0])
        args = KVArgs.from_numpy(
            [blocks], aux=[aux], state=[state] if state is not None else [], **geometry
        )
        return RankMemory(kv, aux, state, args)
    if config.memory == "host":
        args = KVArgs.from_numpy(
            kv, aux=[aux], state=[state] if state is not None else [], **geometry
        )
        return RankMemory(kv, aux, state, args)
    import torch  # type: ignore[import-not-found,unused-ignore]

    slots = [aux, *([state] if state is not None else [])]
    if config.memory == "torch-cpu":  # the same memory, seen through torch
        kv_tensors = [torch.from_numpy(array).view(torch.bfloat16) for array in kv]
        slot_tensors = [torch.from_numpy(array) for array in slots]
        device_tensors = []
    else:
        kv_tensors = [torch.zeros(array.shape, dtype=torch.bfloat16, device="cuda") for array in kv]
        slot_tensors = [
            torch.zeros(array.shape, dtype=torch.uint8, device="cuda") for array in slots
        ]
        device_tensors = [*kv_tensors, *slot_tensors]
    args = KVArgs.from_torch(kv_tensors, aux=slot_tensors[:1], state=slot_tensors[1:], **geometry)
    return RankMemory(kv, aux, state, args, device_tensors)


def state_content(room: int, rows: range) -> npt.NDArray[np.uint8]:
    """A request's state rows: each 8-byte word says (room, global row)."""
    words = np.array([(room << 32) | row for row in rows], dtype=np.uint64)
    repeated = np.repeat(words[:, None], STATE_ROW_BYTES // 8, axis=1)
    content: npt.NDArray[np.uint8] = repeated.view(np.uint8)
    return content


def token_words(array: npt.NDArray[Any], pages: npt.NDArray[Any], tokens: int) -> npt.NDArray[Any]:
    """The request's tokens in a [pages, page_size, heads, head_dim] uint16 buffer, as
    [tokens, heads, head_dim // 4] uint64 words (a copy when `pages` scatter)."""
    _, page_size, heads, head_dim = array.shape
    flat = array[pages].reshape(pages.size * page_size, heads, head_dim)[:tokens]
    words: npt.NDArray[Any] = flat.view(np.uint64)
    return words


def run_prefill(
    config: DemoConfig, rank: int, bootstrap_url: str, events: DemoEvents, results: Any
) -> None:
    from kvbridge.prefill import PrefillManager

    report = RankReport("prefill", rank, ok=False)
    manager = None
    stop_busy_loop = threading.Event()
    try:
        pages_per_request = config.pages_per_request
        tp, shape = config.prefill_tp, config.shape
        memory = allocate_rank(config, rank, tp, config.requests * pages_per_request)
        kv, aux, state, args = memory.kv, memory.aux, memory.state, memory.args
        heads = rank_head_range(config, rank, tp)
        manager = PrefillManager(args, config.manager_config(bootstrap_url, config.prefill_host))
        written: list[tuple[int, str, TransferPlan]] = []
        if config.measure_raw:  # the raw replay rewrites the blocks kvbridge wrote
            manager.observe_writes(lambda room, peer, plan: written.append((room, peer, plan)))
        report.transport = manager.engine.transport
        for room in range(config.requests):
            pages = np.arange(room * pages_per_request, (room + 1) * pages_per_request)
            for buffer, array in enumerate(kv):
                words = shape.head_dim // 4
                content = kv_content(room, buffer, config.tokens, heads, shape.kv_heads, words)
                # The pool's pages for this room are contiguous: one block of the array, its
                # rows written from the content (through a copy where pages are a block apart).
                block = array[pages[0] : pages[-1] + 1]
                filled = np.zeros((block.shape[0] * config.page_size, *block.shape[2:]), np.uint16)
                filled[: config.tokens].view(np.uint64)[:] = content
                block[...] = filled.reshape(block.shape)
            aux[room] = np.frombuffer(np.uint64(room).tobytes() * (AUX_BYTES // 8), np.uint8)
            if state is not None:
                rows = STATE_ROWS // tp
                state[room] = state_content(room, range(rank * rows, (rank + 1) * rows))
        memory.to_device()
        if config.prefill_switch_interval_s is not None:
            sys.setswitchinterval(config.prefill_switch_interval_s)
        if config.prefill_busy_loop:
            threading.Thread(
                target=_busy_loop, args=(stop_busy_loop,), name="demo-busy-loop", daemon=True
            ).start()
        events.filled[rank].set()
        active = []
        for room in range(config.rooms):
            slot = config.slot(room)
            pages = np.arange(slot * pages_per_request, (slot + 1) * pages_per_request)
            sender = manager.sender(room)
            for chunk_index, chunk in enumerate(np.array_split(pages, config.chunks)):
                last = chunk_index == config.chunks - 1
                slots = [slot] if last and state is not None else []
                sender.send(chunk, last=last, aux_index=slot if last else None, state_indices=slots)
            active.append(sender)
        deadline = time.monotonic() + config.timeout_s
        timed, warmup = active[: config.requests], active[config.requests :]
        warmup_bytes = 0
        if warmup:
            _wait_for_rooms(manager, warmup, deadline)
            if config.measure_raw and wait_all(events.warmed, config.timeout_s):
                rooms = range(config.requests, config.rooms)
                report.raw_seconds_before, warmup_bytes, _ = _replay_raw(
                    manager, written, config, events, rooms
                )
            events.replayed[rank].set()
        _wait_for_rooms(manager, timed, deadline)
        for sender in active:
            if sender.poll() != KVPoll.Success:
                report.failed_rooms[sender.room] = sender.failure_reason or str(sender.poll())
        report.rooms = len(active)
        report.staged_chunks = manager.stats.staged_chunks
        report.staging_fallbacks = manager.stats.staging_fallbacks
        report.chunk_paths = {
            f"{path.value} ({reason.value})": count
            for (path, reason), count in manager.stats.chunks_written.items()
        }
        writes = manager.pipeline.stats
        report.blocks_written = writes.blocks_written
        report.timings = {
            "staging_wait_s": manager.stats.staging_wait_s,
            "gather_s": writes.gather_s,
            "plan_s": writes.plan_s,
            "write_s": writes.write_s,
            "control_cpu_s": manager.channel.stats.cpu_seconds,
            "engine_call_s": manager.engine_waits.busy_s,
            "engine_call_wait_s": manager.engine_waits.waited_s,
        }
        report.ok = not report.failed_rooms
        if config.measure_raw and report.ok and wait_all(events.verified, config.timeout_s):
            report.raw_seconds, report.raw_bytes, report.raw_blocks = _replay_raw(
                manager, written, config, events, range(config.requests)
            )
            if report.raw_seconds_before and warmup_bytes != report.raw_bytes:
                raise RuntimeError(
                    f"the warm-up batch wrote {warmup_bytes} bytes, the timed "
                    f"batch {report.raw_bytes}: not the same blocks"
                )
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        events.filled[rank].set()  # (also after an error: decode's rooms then fail fast)
        events.replayed[rank].set()
        # A rank that replays no more (done, or failed before) frees the others from waiting.
        events.raw_start.abort()
        events.prefill_done[rank].set()
        stop_busy_loop.set()
        results.put(asdict(report))
        if manager is not None:
            # Decode reads the last statuses (and its verification ends) before sockets go.
            wait_all(events.decode_done, config.timeout_s)
            manager.close()


def _busy_loop(stop: threading.Event) -> None:
    """Run Python without ever blocking until `stop` is set (checked every 100k steps)."""
    steps = 0
    while not (steps % 100_000 == 0 and stop.is_set()):
        steps += 1


# Ways to replay the written blocks through the engine alone; the best is the baseline: all
# of a peer's blocks in one write, or each write kvbridge made on its own with at most this
# many in flight (several at once keep an engine busy between writes; one huge write lets it
# pipeline internally).
RAW_STRATEGIES: dict[str, int | None] = {
    "one write per peer": None,
    "per-chunk writes, 1 in flight": 1,
    "per-chunk writes, 2 in flight": 2,
    "per-chunk writes, 4 in flight": 4,
}


def _wait_for_rooms(manager: Any, senders: list[Any], deadline: float) -> None:
    """Wait until every sender's room ended, on the manager's activity event (a loop that
    polled every room every few milliseconds would take CPU from the transfers). Only the
    oldest room not yet seen ending is looked at each time: every room must end anyway."""
    waiting = deque(senders)
    while waiting and time.monotonic() < deadline:
        manager.activity.clear()  # before looking: an end after the look wakes the wait
        while waiting and waiting[0].poll() in (KVPoll.Success, KVPoll.Failed):
            waiting.popleft()
        if waiting:
            manager.activity.wait(0.05)


def _replay_raw(
    manager: Any,
    observed: list[tuple[int, str, TransferPlan]],
    config: DemoConfig,
    events: DemoEvents,
    rooms: range,
) -> tuple[dict[str, float], int, int]:
    """The blocks kvbridge wrote for `rooms`, through the engine alone, in every way of
    `RAW_STRATEGIES`: (seconds of each way, bytes, blocks). Called once decode has verified
    what kvbridge delivered (the replays rewrite the same bytes); the prefill ranks start
    each way together. `observed`: (room, engine peer, plan) of every write that ended."""
    written = [(peer, plan) for room, peer, plan in observed if room in rooms]
    by_peer: dict[str, list[TransferPlan]] = {}
    for peer, plan in written:
        by_peer.setdefault(peer, []).append(plan)
    whole = [(peer, TransferPlan.concat(*plans)) for peer, plans in by_peer.items()]
    seconds = {}
    for name, window in RAW_STRATEGIES.items():
        events.raw_start.wait(config.timeout_s)
        writes = whole if window is None else written
        seconds[name] = _timed_writes(manager.engine, writes, window, config.timeout_s)
    total_bytes = sum(plan.total_bytes for _, plan in written)
    return seconds, total_bytes, sum(len(plan) for _, plan in written)


def _timed_writes(
    engine: Any, writes: list[tuple[str, TransferPlan]], window: int | None, timeout_s: float
) -> float:
    """Seconds to move `writes` in order through the engine, at most `window` at once (None:
    all at once), polling each until it is done — as prefill's engine thread waits: between
    polls it sleeps 0.1 ms, or, with an engine that moves writes on its own threads, until one
    of them ended (kvbridge's and the raw engine's side alike)."""
    from kvbridge.write_pipeline import WRITE_POLL_S, WRITE_WAIT_S

    pending = list(writes)
    out: list[Any] = []
    ended = threading.Event()
    told_of_ends = engine.progresses_on_its_own
    if told_of_ends:
        engine.add_write_end_listener(ended.set)
    try:
        started = time.perf_counter()
        while pending or out:
            while pending and (window is None or len(out) < window):
                peer, plan = pending.pop(0)
                out.append(engine.write(peer, plan))
            ended.clear()  # before looking: an end after the look wakes the wait
            out = [h for h in out if not h.check(started, timeout_s)]
            if out and told_of_ends:
                ended.wait(WRITE_WAIT_S)
            elif out:
                time.sleep(WRITE_POLL_S)
        return time.perf_counter() - started
    finally:
        if told_of_ends:
            engine.remove_write_end_listener(ended.set)


def run_decode(
    config: DemoConfig, rank: int, bootstrap_url: str, events: DemoEvents, results: Any
) -> None:
    from kvbridge.decode import DecodeManager

    report = RankReport("decode", rank, ok=False)
    manager = None
    try:
        tp_rank, dcp_rank = divmod(rank, config.dcp)
        tokens = config.local_tokens(dcp_rank)
        pages_per_request = math.ceil(tokens / config.page_size)
        tp, shape = config.decode_tp, config.shape
        pool = math.ceil(config.requests * pages_per_request * config.decode_pool_factor)
        memory = allocate_rank(config, tp_rank, tp, pool)
        kv, aux, state, args = memory.kv, memory.aux, memory.state, memory.args
        args = dataclasses.replace(args, dcp_rank=dcp_rank, dcp_size=config.dcp)
        heads = rank_head_range(config, tp_rank, tp)
        manager = DecodeManager(args, config.manager_config(bootstrap_url, config.decode_host))
        report.transport = manager.engine.transport
        scattered = np.random.default_rng(rank).permutation(pool)
        if not wait_all(events.filled, config.timeout_s):
            raise TimeoutError("the prefill group never filled its pages")
        receivers = [manager.receiver(room) for room in range(config.rooms)]
        deadline = time.monotonic() + config.timeout_s
        ended = (KVPoll.Success, KVPoll.Failed)

        def pages_of(room: int) -> npt.NDArray[Any]:
            slot = config.slot(room)
            return scattered[slot * pages_per_request : (slot + 1) * pages_per_request]

        def run_batch(rooms: range) -> tuple[dict[int, float], dict[int, float]]:
            """Ask for the rooms' transfers at once; when each was asked for and seen ending.
            The scheduler waits for rooms to end on the manager's activity event (set whenever
            one may have), as a serving engine's idle step does, rather than spinning. Nothing
            else happens meanwhile: progress is reported as rooms are verified, after the
            batch (a message to the parent process per room took CPU from the transfers)."""
            sent_at: dict[int, float] = {}
            for room in rooms:
                sent_at[room] = time.perf_counter()
                slot = config.slot(room)
                slots = [slot] if state is not None else []
                receivers[room].init(pages_of(room), aux_index=slot, state_indices=slots)
            done: dict[int, float] = {}
            waiting = set(rooms)
            while waiting and time.monotonic() < deadline:
                manager.activity.clear()  # before looking: an end after the look wakes the wait
                now = time.perf_counter()
                for room in [room for room in waiting if receivers[room].poll() in ended]:
                    waiting.discard(room)
                    done[room] = now
                if waiting:
                    manager.activity.wait(0.05)
            return sent_at, done

        def delivered(room: int) -> bool:
            """Whether the room succeeded with every byte in place (its slot's content); the
            report says why not."""
            receiver = receivers[room]
            if receiver.poll() != KVPoll.Success:
                report.failed_rooms[room] = receiver.failure_reason or f"state {receiver.poll()}"
                return False
            slot, pages = config.slot(room), pages_of(room)
            same = all(
                np.array_equal(
                    token_words(array, pages, tokens),
                    kv_content(
                        slot, buffer, config.tokens, heads, shape.kv_heads, shape.head_dim // 4
                    )[dcp_rank :: config.dcp],
                )
                for buffer, array in enumerate(kv)
            )
            same &= bool((aux[slot].view(np.uint64) == slot).all())
            if state is not None:
                rows = STATE_ROWS // tp
                expected = state_content(slot, range(tp_rank * rows, (tp_rank + 1) * rows))
                same &= bool(np.array_equal(state[slot], expected))
            if not same:
                report.mismatched_rooms.append(room)
            return same

        if config.warmup:
            warmup = range(config.requests, config.rooms)
            run_batch(warmup)
            memory.to_host()
            for room in warmup:
                delivered(room)
            events.warmed[rank].set()
            if config.measure_raw:  # prefill replays the warm-up's blocks: stay reachable
                manager.poll_engine_often(True)
                wait_all(events.replayed, config.timeout_s)
                manager.poll_engine_often(False)
            # Zeroed again only now: the replay wrote the warm-up's blocks, which are the
            # timed batch's, into these same pages, and what the timed batch is checked for
            # must be its own writing.
            for array in memory.host_arrays:
                array.fill(0)
            memory.to_device()
            report.warmup_done_at = time.monotonic()
        timed = range(config.requests)
        if memory.holds_data([pages_of(room)[0] for room in timed]):
            raise RuntimeError(
                "decode's pages hold data before the timed batch: its bytes "
                "could not be told from what was there"
            )
        events.timed_start.wait(config.timeout_s)
        report.timed_started_at = time.monotonic()
        started = time.perf_counter()
        sent_at, done = run_batch(timed)
        report.seconds = max(done.values(), default=started) - started
        memory.to_host()
        for room in timed:
            delivered(room)
            results.put({"progress": room})
            if room in done and receivers[room].poll() == KVPoll.Success:
                report.latencies_ms.append((done[room] - sent_at[room]) * 1e3)
                # A token's row of one buffer (`args` may see opaque pages: cross-layer).
                report.bytes += tokens * kv[0][0, 0].nbytes * len(kv) + AUX_BYTES
        report.rooms = len(timed)
        report.timings = {
            "scatter_s": manager.stats.scatter_s,
            "control_cpu_s": manager.channel.stats.cpu_seconds,
        }
        report.ok = not report.failed_rooms and not report.mismatched_rooms
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        events.warmed[rank].set()  # (also after an error: prefill stops waiting for it)
        events.timed_start.abort()  # (the other decode ranks' timed batch then fails fast)
        events.verified[rank].set()
        results.put(asdict(report))
        if manager is not None:
            # Stay reachable while prefill replays the blocks, polling the engine as during
            # the transfers (the target drives NIXL too: over TCP it moves the data).
            manager.poll_engine_often(config.measure_raw)
            wait_all(events.prefill_done, config.timeout_s)
            manager.close()
        events.decode_done[rank].set()


@dataclass
class DemoResult:
    config: DemoConfig
    reports: list[RankReport]

    @property
    def ok(self) -> bool:
        expected = self.config.prefill_tp + self.config.decode_ranks
        return len(self.reports) == expected and all(r.ok for r in self.reports)

    @property
    def decode_reports(self) -> list[RankReport]:
        return [r for r in self.reports if r.role == "decode"]

    @property
    def requests_verified(self) -> int:
        """Requests whose every decode rank received and verified its part."""
        return min((r.rooms for r in self.decode_reports), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.decode_reports)

    @property
    def chunk_paths(self) -> dict[str, int]:
        """Every prefill rank's chunk writes by "path (reason)"."""
        paths: Counter[str] = Counter()
        for report in self.reports:
            paths.update(report.chunk_paths)
        return dict(paths)

    def summary(self) -> dict[str, Any]:
        """The run as one JSON-ready record (`kvbridge demo --json`)."""
        config = self.config
        return {
            "ok": self.ok,
            "model": config.model,
            "requests": config.requests,
            "tokens": config.tokens,
            "page_size": config.page_size,
            "prefill_tp": config.prefill_tp,
            "decode_tp": config.decode_tp,
            "dcp": config.dcp,
            "engine": config.engine,
            "transport": sorted({r.transport for r in self.reports if r.transport}),
            "requests_verified": self.requests_verified,
            "write_path": config.transfer.write_path,
            "chunks": self.chunk_paths,
            "bytes": self.total_bytes,
            "gbps": round(self.gbps, 3),
            "p50_ms": round(self.latency_ms(0.5), 1),
            "p99_ms": round(self.latency_ms(0.99), 1),
            "failures": [
                {"role": r.role, "rank": r.rank, "room": room, "reason": why}
                for r in self.reports
                for room, why in sorted(r.failed_rooms.items())
            ]
            + [
                {"role": r.role, "rank": r.rank, "room": None, "reason": r.error}
                for r in self.reports
                if r.error
            ],
            "mismatched_rooms": sorted({room for r in self.reports for room in r.mismatched_rooms}),
        }

    @property
    def gbps(self) -> float:
        seconds = max((r.seconds for r in self.decode_reports), default=0.0)
        return self.total_bytes / seconds / 1e9 if seconds else 0.0

    def raw_strategy_gbps(self, when: str = "around") -> dict[str, float]:
        """GB/s of each way of replaying the blocks through the raw engine (every prefill
        rank replaying its own at once): measured "before" the timed batch (with a warm-up
        batch), "after" it, or — "around", the baseline — the mean of the two where both
        were measured (it brackets the timed batch in time, so that a machine whose speed
        drifts moves both sides of the ratio alike), else the one that was."""
        prefill = [r for r in self.reports if r.role == "prefill"]
        total = sum(r.raw_bytes for r in prefill)

        def rates(seconds_of: Callable[[RankReport], dict[str, float]]) -> dict[str, float]:
            measured = {}
            for name in RAW_STRATEGIES:
                seconds = max((seconds_of(r).get(name, 0.0) for r in prefill), default=0.0)
                if seconds:
                    measured[name] = total / seconds / 1e9
            return measured

        before = rates(lambda report: report.raw_seconds_before)
        after = rates(lambda report: report.raw_seconds)
        if when == "before":
            return before
        if when == "after":
            return after
        return {
            name: (before[name] + gbps) / 2 if name in before else gbps
            for name, gbps in after.items()
        }

    @property
    def raw_gbps(self) -> float:
        """The raw engine at its best: the fastest way of replaying the blocks."""
        return max(self.raw_strategy_gbps().values(), default=0.0)

    def latency_ms(self, quantile: float) -> float:
        values = [v for r in self.decode_reports for v in r.latencies_ms]
        return float(np.quantile(values, quantile)) if values else float("nan")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _rank_process(
    target: Callable[..., None], parent_pid: int, config: DemoConfig, *args: Any
) -> None:
    """Entry of every rank process. Interrupts are the parent's to handle (it stops the ranks
    at once); a rank never outlives its parent, even one killed with SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    if target is run_decode and config.decode_netns is not None:
        from kvbridge_tools import netns

        netns.enter(config.decode_netns)  # before any thread or socket of this process
    target(config, *args)


def _stop(processes: list[Any], grace_s: float) -> None:
    """Give the ranks `grace_s` to finish on their own, then end them: SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def results_until(
    results: Any, processes: list[Any], done: Callable[[], bool], deadline: float
) -> Iterator[dict[str, Any]]:
    """What the rank processes put on `results`, as it comes, until `done()`, the deadline,
    or no process is left alive to put anything."""
    while not done() and time.monotonic() < deadline:
        try:
            yield results.get(timeout=0.5)
        except queue.Empty:
            if not any(process.is_alive() for process in processes):
                return


def run_demo(config: DemoConfig, on_progress: Any = None) -> DemoResult:
    """Run the whole demo; `on_progress(rooms_done)` is called as decode completes rooms.
    `DemoConfigError` at once for a run that cannot work here."""
    from kvbridge.control.bootstrap import BootstrapServer

    config.check()

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    events = DemoEvents(
        filled=[context.Event() for _ in range(config.prefill_tp)],
        warmed=[context.Event() for _ in range(config.decode_ranks)],
        replayed=[context.Event() for _ in range(config.prefill_tp)],
        verified=[context.Event() for _ in range(config.decode_ranks)],
        prefill_done=[context.Event() for _ in range(config.prefill_tp)],
        decode_done=[context.Event() for _ in range(config.decode_ranks)],
        raw_start=context.Barrier(config.prefill_tp),
        timed_start=context.Barrier(config.decode_ranks),
    )
    bootstrap = BootstrapServer(config.prefill_host).start()
    processes = [
        context.Process(
            target=_rank_process,
            args=(target, os.getpid(), config, rank, bootstrap.url, events, results),
            name=f"kvbridge-{role}-{rank}",
        )
        for role, target, tp in (
            ("prefill", run_prefill, config.prefill_tp),
            ("decode", run_decode, config.decode_ranks),
        )
        for rank in range(tp)
    ]
    for process in processes:
        process.start()
    reports: list[RankReport] = []
    progressed = 0
    deadline = time.monotonic() + config.timeout_s + 60
    grace_s = 10.0  # finished ranks close their managers and exit by themselves
    try:
        everyone = len(processes)
        for item in results_until(results, processes, lambda: len(reports) == everyone, deadline):
            if "progress" in item:
                progressed += 1
                if on_progress is not None:
                    on_progress(progressed)
            else:
                reports.append(RankReport(**item))
    except BaseException:  # interrupted (SIGINT, or SIGTERM through the CLI): stop at once
        grace_s = 0.0
        raise
    finally:
        _stop(processes, grace_s)
        bootstrap.close()
    reported = {f"kvbridge-{r.role}-{r.rank}" for r in reports}
    for process in processes:
        if process.name not in reported:  # died before it could report (a crash, a kill)
            role, rank = process.name.split("-")[1:]
            error = f"exited with {process.exitcode} before reporting"
            reports.append(RankReport(role, int(rank), ok=False, error=error))
    return DemoResult(config, reports)


def chunk_paths_text(paths: Mapping[str, int]) -> str:
    """Chunk writes by path, most first: "ring (configured) 32, direct (too_big) 2"."""
    ranked = sorted(paths.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{path} {count}" for path, count in ranked) or "none"
