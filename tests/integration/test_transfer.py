"""End to end between real processes: a prefill group and a decode group, a real engine,
requests with scattered decode pages, chunked prefill; every byte verified on decode."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge import ManagerConfig
from kvbridge.engines import unavailable_reason
from kvbridge_tools.demo import RAW_STRATEGIES, DemoConfig, DemoConfigError, run_demo
from kvbridge_tools.layerwise import LayerwiseConfig


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def require(engine: str) -> None:
    reason = unavailable_reason(engine)
    if reason is not None:
        pytest.skip(f"{engine} cannot be used here: {reason}")


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "chunks", "staging", "page_size"),
    [
        (1, 1, 1, True, 16),
        (1, 1, 4, True, 16),
        (2, 2, 3, True, 16),
        (2, 4, 2, True, 16),  # one source per decode rank, 8 KiB pages: through the ring
        (2, 4, 2, True, 64),  # 32 KiB pages: gathered rows straight into decode's pages
        (4, 2, 1, True, 16),
        (2, 4, 2, False, 16),
    ],
)
def test_nixl_requests_arrive_byte_exact(
    prefill_tp: int, decode_tp: int, chunks: int, staging: bool, page_size: int
) -> None:
    require("nixl")
    config = DemoConfig(
        requests=6,
        tokens=300,
        page_size=page_size,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        chunks=chunks,
        transfer=ManagerConfig(engine="nixl", staging=staging),
    )
    result = run_demo(config)
    assert result.ok, [report for report in result.reports if not report.ok]
    staged = sum(report.staged_chunks for report in result.reports)
    if staging and prefill_tp != decode_tp:
        assert staged > 0
    else:
        assert staged == 0
    # Decode scatters what went through its ring, nothing that went straight into its pages.
    scattered = sum(report.timings["scatter_s"] for report in result.decode_reports)
    # The cost model writes these chunks' gathered rows straight into decode's 32 KiB pages
    # (page 64), through its ring into 8 KiB ones (page 16).
    direct = prefill_tp < decode_tp and page_size == 64
    assert (scattered > 0) == (staged > 0 and not direct)
    assert sum(report.rooms for report in result.decode_reports) == 6 * decode_tp
    expected = decode_tp * 6 * (300 * config.shape.bytes_per_token(decode_tp) + 64)
    assert result.total_bytes == expected


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "dcp"), [(1, 1, 1), (2, 4, 1), (2, 1, 2)])
def test_a_warm_up_batch_and_raw_replays_around_the_timed_one(
    prefill_tp: int, decode_tp: int, dcp: int
) -> None:
    """What benchmarks run: a warm-up batch of every request into the same pages (verified),
    the raw engine replaying its blocks before the timed batch and the timed batch's after it
    (the baseline is the mean of the two); decode's pages are zeroed after the first replay,
    which writes the timed batch's bytes into them, and the demo fails if they are not blank
    when the timed batch starts: its bytes must be kvbridge's own."""
    require("nixl")
    config = DemoConfig(
        requests=4,
        tokens=200,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        dcp=dcp,
        warmup=True,
        measure_raw=True,
        transfer=ManagerConfig(engine="nixl"),
    )
    result = run_demo(config)
    assert result.ok, [report for report in result.reports if not report.ok]
    assert result.requests_verified == 4
    assert all(len(report.latencies_ms) == 4 for report in result.decode_reports)  # timed only
    before, after = result.raw_strategy_gbps("before"), result.raw_strategy_gbps("after")
    assert set(before) == set(after) == set(RAW_STRATEGIES)
    for name, gbps in result.raw_strategy_gbps().items():
        assert gbps == pytest.approx((before[name] + after[name]) / 2)
    assert result.raw_gbps == max(result.raw_strategy_gbps().values())


def test_decode_ranks_start_the_timed_batch_together_after_the_warm_up() -> None:
    """No decode rank times its batch while another still verifies the warm-up or zeroes its
    pages on the same CPUs (with no raw replays between them, nothing else lines them up)."""
    require("nixl")
    config = DemoConfig(
        requests=4,
        tokens=200,
        prefill_tp=1,
        decode_tp=2,
        warmup=True,
        transfer=ManagerConfig(engine="nixl"),
    )
    result = run_demo(config)
    assert result.ok, [report for report in result.reports if not report.ok]
    decode = result.decode_reports
    assert len(decode) == 2
    assert all(report.warmup_done_at > 0 for report in decode)
    assert min(r.timed_started_at for r in decode) >= max(r.warmup_done_at for r in decode)


def test_a_prefill_process_whose_python_never_waits() -> None:
    """`benchmarks/busy_host.py`'s stand-in for a serving engine's scheduler: a busy Python
    loop in the prefill process (and a short switch interval there) slows the transfers but
    loses nothing; progress is reported once per verified room, after the timed batch."""
    require("nixl")
    progressed: list[int] = []
    config = DemoConfig(
        requests=4,
        tokens=64,
        prefill_busy_loop=True,
        prefill_switch_interval_s=0.001,
        transfer=ManagerConfig(engine="nixl"),
    )
    result = run_demo(config, progressed.append)
    assert result.ok, [report for report in result.reports if not report.ok]
    assert result.requests_verified == 4
    assert progressed == [1, 2, 3, 4]
    # The engine thread's calls waited for the GIL most of the time, and it says so.
    (prefill,) = [report for report in result.reports if report.role == "prefill"]
    assert prefill.timings["engine_call_wait_s"] > 0.3 * prefill.timings["engine_call_s"] > 0
    with pytest.raises(DemoConfigError, match="switch interval"):
        DemoConfig(prefill_switch_interval_s=0.0).check()


@pytest.mark.parametrize(
    "memory",
    [
        "torch-cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not _cuda_available(), reason="no CUDA device here")
        ),
    ],
)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 4), (4, 2)])
def test_torch_tensors_arrive_byte_exact(memory: str, prefill_tp: int, decode_tp: int) -> None:
    """KVArgs from torch tensors; where TP differs, the torch staging kernels gather and
    scatter (on CPU tensors here, on the GPU's own stream with `cuda`)."""
    require("nixl")
    pytest.importorskip("torch", reason="torch memory needs torch")
    config = DemoConfig(
        requests=4,
        tokens=200,
        page_size=16,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        memory=memory,
        transfer=ManagerConfig(engine="nixl"),
    )
    result = run_demo(config)
    assert result.ok, [report for report in result.reports if not report.ok]
    staged = sum(report.staged_chunks for report in result.reports)
    assert (staged > 0) == (prefill_tp != decode_tp)


@pytest.mark.parametrize(("model", "tp"), [("llama3-8b", 1), ("llama3-8b", 2), ("deepseek-v3", 2)])
def test_cross_layer_kv_moves_a_run_of_pages_in_one_descriptor_for_every_layer(
    model: str, tp: int
) -> None:
    """Block-outermost KV (each buffer a view of one allocation, every buffer's page of a
    block side by side): every byte of every layer arrives, and prefill writes each request
    in one descriptor per run of pages — decode's pages are scattered, so one per page, not
    one per page and buffer as laid out layer by layer. State and aux move beside it."""
    require("nixl")
    runs = {}
    for cross_layer in (False, True):
        config = DemoConfig(
            model=model,
            requests=3,
            tokens=200,
            prefill_tp=tp,
            decode_tp=tp,
            cross_layer=cross_layer,
            transfer=ManagerConfig(engine="nixl", write_path="direct"),
        )
        result = run_demo(config)
        assert result.ok, result.reports
        expected = tp * 3 * (200 * config.shape.bytes_per_token(tp) + 64)
        assert result.total_bytes == expected
        runs[cross_layer] = sum(r.blocks_written for r in result.reports if r.role == "prefill")
    # A descriptor per page at most, beside aux and state; laid out layer by layer, one per
    # page and buffer (runs of adjacent pages aside): 64 or 61 buffers here.
    assert runs[True] <= 3 * tp * (-(-200 // 16) + 2)
    assert runs[False] > 30 * runs[True]


def test_cross_layer_kv_needs_equal_tp_and_host_memory() -> None:
    for changes in ({"decode_tp": 2}, {"dcp": 2}, {"memory": "torch-cpu"}):
        config = DemoConfig(requests=1, tokens=16, cross_layer=True, **changes)  # type: ignore[arg-type]
        with pytest.raises(DemoConfigError, match="--cross-layer moves whole blocks"):
            config.check()
    layerwise = LayerwiseConfig(DemoConfig(requests=1, tokens=16, cross_layer=True))
    with pytest.raises(DemoConfigError, match="--layerwise writes each layer's pages"):
        layerwise.check()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (4, 2), (1, 2)])
def test_mla_model_arrives_byte_exact(prefill_tp: int, decode_tp: int) -> None:
    """MLA: one prefill rank feeds each decode rank, the others answer dummy requests."""
    require("nixl")
    config = DemoConfig(
        model="deepseek-v3",
        requests=3,
        tokens=64,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        transfer=ManagerConfig(engine="nixl"),
    )
    result = run_demo(config)
    assert result.ok, result.reports
    writers = [r for r in result.reports if r.role == "prefill" and r.blocks_written]
    assert len(writers) == min(prefill_tp, decode_tp)  # no byte sent twice


def test_mooncake_requests_arrive_byte_exact(private_netns: list[str]) -> None:
    require("mooncake")
    command = [
        *private_netns,
        sys.executable,
        "-m",
        "kvbridge",
        "demo",
        "--engine",
        "mooncake",
        "--requests",
        "6",
        "--tokens",
        "300",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "4",
        "--chunks",
        "3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bytes" in result.stdout
    assert "engine: mooncake (tcp)" in result.stdout


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp", "dcp", "staging"),
    [
        ("llama3-8b", 1, 1, 2, True),
        ("llama3-8b", 2, 1, 2, True),
        ("llama3-8b", 2, 1, 2, False),
        ("deepseek-v3", 2, 1, 4, True),
    ],
)
def test_decode_context_parallelism(
    model: str, prefill_tp: int, decode_tp: int, dcp: int, staging: bool
) -> None:
    """Token i lands on DCP rank i % dcp at local token i // dcp, on every decode process."""
    require("nixl")
    config = DemoConfig(
        model=model,
        requests=3,
        tokens=333,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        dcp=dcp,
        transfer=ManagerConfig(staging=staging, engine="nixl"),
    )
    result = run_demo(config)
    assert result.ok, [report for report in result.reports if not report.ok]
    assert len(result.decode_reports) == decode_tp * dcp
