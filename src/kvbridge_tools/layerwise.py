"""`kvbridge demo --layerwise`: what layer-wise writes leave after prefill's forward pass.

A prefill rank and a decode rank, separate processes and a real engine, as `kvbridge demo`.
Each request goes twice over identical work, the order alternating: decode asks first (its
request waits on prefill, as in a decode-first flow), then prefill runs a simulated forward
(`layer_ms` of sleep per layer, the engine free to move bytes meanwhile) and either writes
each layer as it is computed (layer-wise: every layer handed over before the forward behind
a `WriteGate`, opened as the layer is done) or the whole request after the last layer
(whole-request). The tail is the time from the last layer computed to the room complete on
decode (time.monotonic: one clock for every process of the host); the whole-request tail is
the whole transfer. `tail_ratio` = layer-wise tail ÷ (whole-request tail / layers): 1 when
only the last layer's share is left. Decode verifies every byte of every room.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge.wire import KVPoll
from kvbridge.write_gate import WriteGate
from kvbridge_tools.demo import (
    DemoConfig,
    DemoConfigError,
    _rank_process,
    _stop,
    allocate_rank,
    kv_content,
    rank_head_range,
    results_until,
    token_words,
)

MODES = ("whole", "layerwise")
POLL_S = 50e-6  # how often decode polls a room: well below a layer's write
# Prefill's wait for the room's end, after the forward (a real prefill goes on with its next
# batch meanwhile; polling as often as decode took a core's share from both copies).
PREFILL_POLL_S = 1e-3
PR_SET_TIMERSLACK = 29  # prctl(2)
TIMER_SLACK_NS = 1000


def fine_sleeps() -> None:
    """Sleeps as short as asked: the tail ends when decode's poll sees the room complete,
    and with Linux's default timer slack (50 µs) a sleep of `POLL_S` lasts about 140 µs
    here, a third of a layer's copy at 61 layers × 1k tokens."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)


@dataclass(frozen=True)
class LayerwiseConfig:
    """A layer-wise demo: the demo's model, sizes and engine (TP 1 → 1, host or GPU memory),
    `requests` rooms per mode, and the simulated compute time of one layer."""

    demo: DemoConfig
    layer_ms: float = 4.0

    def check(self) -> None:
        if (self.demo.prefill_tp, self.demo.decode_tp, self.demo.dcp) != (1, 1, 1):
            raise DemoConfigError("--layerwise runs one prefill and one decode rank (TP 1 → 1)")
        if self.layer_ms <= 0:
            raise DemoConfigError(f"--layer-ms must be positive, not {self.layer_ms}")
        if self.demo.cross_layer:
            raise DemoConfigError(
                "--layerwise writes each layer's pages as computed: a --cross-layer cache "
                "moves whole blocks of every layer"
            )
        # Both modes' rooms live in decode's pool at once: twice the requests.
        replace(self.demo, requests=2 * self.demo.requests).check()

    def room(self, request: int, mode: str) -> int:
        return 2 * request + MODES.index(mode)

    def order(self) -> list[tuple[int, str]]:
        """(request, mode) in the order they run: the mode that goes first alternates."""
        return [
            (request, mode)
            for request in range(self.demo.requests)
            for mode in (MODES if request % 2 == 0 else MODES[::-1])
        ]


@dataclass
class Report:
    """What a rank process says: per room, when its forward ended (prefill) or when the
    room completed (decode), and what went wrong."""

    role: str
    ended_at: dict[int, float] = field(default_factory=dict)
    verified: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    error: str | None = None


def run_prefill(
    demo: DemoConfig, config: LayerwiseConfig, bootstrap_url: str, asked: Any, results: Any
) -> None:
    from kvbridge.prefill import PrefillManager

    report, manager = Report("prefill"), None
    try:
        per_request, shape = demo.pages_per_request, demo.shape
        memory = allocate_rank(demo, 0, 1, demo.requests * per_request)
        heads = rank_head_range(demo, 0, 1)
        for request in range(demo.requests):
            span = slice(request * per_request, (request + 1) * per_request)
            for buffer, array in enumerate(memory.kv):
                content = kv_content(
                    request, buffer, demo.tokens, heads, shape.kv_heads, shape.head_dim // 4
                )
                view = array[span].reshape(-1, heads.count, shape.head_dim)
                view[: demo.tokens].view(np.uint64)[:] = content
            memory.aux[request] = request % 251 + 1
        memory.to_device()
        manager = PrefillManager(memory.args, demo.manager_config(bootstrap_url, demo.prefill_host))
        layers, layer_s = shape.layers, config.layer_ms / 1e3
        for request, mode in config.order():
            room = asked.get(timeout=demo.timeout_s)  # decode asked for it
            assert room == config.room(request, mode), "the sides run the rooms in one order"
            pages = np.arange(request * per_request, (request + 1) * per_request)
            sender = manager.sender(room)
            deadline = time.monotonic() + demo.timeout_s
            while sender.poll() != KVPoll.WaitingForInput and time.monotonic() < deadline:
                time.sleep(POLL_S)  # its request is in: the forward starts
            gates = [WriteGate() for _ in range(layers)] if mode == "layerwise" else []
            for layer, gate in enumerate(gates):  # handed over before the forward
                last = layer == layers - 1
                aux = request if last else None
                sender.send(
                    pages, layers=range(layer, layer + 1), last=last, aux_index=aux, gate=gate
                )
            for layer in range(layers):
                time.sleep(layer_s)  # the layer's compute
                if layer == layers - 1:
                    report.ended_at[room] = time.monotonic()
                if gates:
                    gates[layer].open()
            if mode == "whole":
                sender.send(pages, last=True, aux_index=request)
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(PREFILL_POLL_S)
            if sender.poll() == KVPoll.Failed:
                report.failed[room] = str(sender.failure_reason)
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        results.put(asdict(report))
        if manager is not None:
            time.sleep(0.5)  # decode reads the last status before the sockets go
            manager.close()


def run_decode(
    demo: DemoConfig, config: LayerwiseConfig, bootstrap_url: str, asked: Any, results: Any
) -> None:
    from kvbridge.decode import DecodeManager

    report, manager = Report("decode"), None
    fine_sleeps()
    try:
        per_request, shape, rooms = demo.pages_per_request, demo.shape, 2 * demo.requests
        memory = allocate_rank(replace(demo, requests=rooms), 0, 1, rooms * per_request)
        manager = DecodeManager(memory.args, demo.manager_config(bootstrap_url, demo.decode_host))
        scattered = np.random.default_rng(0).permutation(rooms * per_request)
        heads = rank_head_range(demo, 0, 1)
        for request, mode in config.order():
            room = config.room(request, mode)
            pages = scattered[room * per_request : (room + 1) * per_request]
            receiver = manager.receiver(room)
            receiver.init(pages, aux_index=room)
            asked.put(room)
            deadline = time.monotonic() + demo.timeout_s
            while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                if time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            report.ended_at[room] = time.monotonic()
            if receiver.poll() != KVPoll.Success:
                report.failed[room] = str(receiver.failure_reason or receiver.poll().name)
                continue
            memory.to_host()
            same = all(
                np.array_equal(
                    token_words(array, pages, demo.tokens),
                    kv_content(
                        request, buffer, demo.tokens, heads, shape.kv_heads, shape.head_dim // 4
                    ),
                )
                for buffer, array in enumerate(memory.kv)
            ) and bool((memory.aux[room] == request % 251 + 1).all())
            if same:
                report.verified.append(room)
            receiver.clear()
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        results.put(asdict(report))
        if manager is not None:
            manager.close()


@dataclass(frozen=True)
class LayerwiseResult:
    config: LayerwiseConfig
    reports: dict[str, Report]

    def tails_ms(self, mode: str) -> list[float]:
        prefill, decode = self.reports["prefill"], self.reports["decode"]
        return [
            (decode.ended_at[room] - prefill.ended_at[room]) * 1e3
            for request in range(self.config.demo.requests)
            if (room := self.config.room(request, mode)) in prefill.ended_at
            and room in decode.verified
        ]

    @property
    def ok(self) -> bool:
        every = 2 * self.config.demo.requests
        return (
            all(r.error is None and not r.failed for r in self.reports.values())
            and len(self.reports["decode"].verified) == every
        )

    def summary(self) -> dict[str, Any]:
        demo, layers = self.config.demo, self.config.demo.shape.layers
        whole, layered = self.tails_ms("whole"), self.tails_ms("layerwise")
        whole_ms = statistics.median(whole) if whole else None
        tail_ms = statistics.median(layered) if layered else None
        per_layer = whole_ms / layers if whole_ms else None
        return {
            "ok": self.ok,
            "model": demo.shape.name,
            "layers": layers,
            "tokens": demo.tokens,
            "requests": demo.requests,
            "engine": demo.engine,
            "memory": demo.memory,
            "layer_ms": self.config.layer_ms,
            "bytes_per_request": demo.tokens * demo.shape.bytes_per_token(),
            "verified": len(self.reports["decode"].verified),
            "whole_request_ms": whole_ms,
            "tail_ms": tail_ms,
            "tail_ratio": tail_ms / per_layer if tail_ms is not None and per_layer else None,
            "whole_request_ms_all": whole,
            "tail_ms_all": layered,
            "errors": {
                role: report.error or report.failed or None for role, report in self.reports.items()
            },
        }


def run_layerwise(config: LayerwiseConfig) -> LayerwiseResult:
    """Run both modes on identical work; `DemoConfigError` at once for a run that cannot
    work here."""
    from kvbridge.control.bootstrap import BootstrapServer

    config.check()
    context = multiprocessing.get_context("spawn")
    results, asked = context.Queue(), context.Queue()
    bootstrap = BootstrapServer(config.demo.prefill_host).start()
    processes = [
        context.Process(
            target=_rank_process,
            args=(target, os.getpid(), config.demo, config, bootstrap.url, asked, results),
            name=f"kvbridge-layerwise-{target.__name__}",
        )
        for target in (run_prefill, run_decode)
    ]
    for process in processes:
        process.start()
    reports: dict[str, Report] = {}
    deadline = time.monotonic() + config.demo.timeout_s * 2 + 60
    grace_s = 10.0  # finished ranks close their managers and exit by themselves
    try:
        for item in results_until(results, processes, lambda: len(reports) == 2, deadline):
            reports[item["role"]] = Report(**item)
    except BaseException:  # interrupted: stop the ranks at once
        grace_s = 0.0
        raise
    finally:
        _stop(processes, grace_s)
        bootstrap.close()
    for role in ("prefill", "decode"):
        reports.setdefault(role, Report(role, error="the rank process died before it reported"))
    return LayerwiseResult(config, reports)
