"""kvbridge's vLLM connector in a serving deployment under load, against vLLM's connectors,
measured by vLLM's own benchmark client.

    .venv-vllm/bin/python benchmarks/vllm_serve.py [--quick] [--deployments 1p1d 2p2d]
        [--connectors ...] [--rates R ...] [--prompts N] [--prefix-len N]

A deployment is xPyD: x prefill and y decode OpenAI servers of vLLM 0.32's CPU build (`python -m
vllm.entrypoints.openai.api_server`, each its own process, one core's worth of threads) behind
`kvbridge vllm-proxy`, which sends each request to the prefill and the decode instance with the
fewest requests in flight (so with two of each every pairing occurs). One connector's
deployment runs at a time, on identical requests: vLLM's benchmark client
(`vllm.benchmarks.serve`) with its random dataset (a word-level tokenizer made offline for the
random model, so that prompts decode and encode back to the same ids), the same seed for
every connector, Poisson arrivals (`--burstiness 1`), output of `--output-len` tokens (decode
is busy generating while later loads arrive), and a shared prefix (`--prefix-len`) so that
prefix caches hit. First a run at an unbounded rate measures the deployment's capacity (the
first connector's sets the rates for all: fractions of it, unless `--rates`), then one run per
rate. `kvbridge-nixl-stream` is kvbridge decode first: the proxy sends each request to both
instances at once and prefill writes each layer during its forward (the whole request where
decode asked too late). Reported per run: TTFT, TPOT, ITL and E2E latency p50/p99, request
and output-token throughput, goodput at the stated SLO, the proxy's own time per request
(p50/p99, without the time spent waiting on instances), and each connector's TTFT and
throughput over the best vLLM connector's at the same rate. Writes
bench-results/vllm-serve.json and vllm-serve.png (without `--quick`: vllm-serve-full.json and
.png).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm_compat"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_harness import InstanceError, Server, free_port, kvbridge_config, make_model
from vllm_pd import CONNECTORS as PD_CONNECTORS
from vllm_pd import transfer_config

from kvbridge.integrations.vllm_proxy import PDProxy
from kvbridge_tools.bench_results import save

RESULTS = Path("bench-results")
VLLM_CONNECTORS = ("vllm-nixl", "vllm-nixl-push")
# kvbridge decode first: the proxy sends each request to both instances at once, decode asks
# prefill for the blocks before prefill's forward and each layer is written during it
# (`kvbridge vllm-proxy --prefill-bootstrap`); against the same connector written whole.
STREAM = "kvbridge-nixl-stream"
CONNECTORS = (*PD_CONNECTORS, STREAM)
DEPLOYMENTS = {"1p1d": (1, 1), "2p2d": (2, 2)}
# The fractions of the measured capacity each deployment runs at (below saturation).
RATE_FRACTIONS = (0.3, 0.55, 0.8)
CLIENT = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
KEYS = ("ttft", "tpot", "itl", "e2el")
# float32: this host's CPUs have no bf16 arithmetic (vLLM emulates it, and prefill's compute
# would dwarf everything else); the KV moves in float32, twice bf16's bytes.
DTYPE = ("--dtype", "float32")
# No server's threads bound to a core: NIXL's progress thread inherits the binding of the
# thread that starts it, and bound to a core that vLLM's compute keeps busy it starved
# (NixlConnector's TTFT was seconds); unbound, the kernel schedules every connector's threads.
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# NixlConnector's UCX worker threads per instance (its `num_threads`; vLLM's default is 4).
NIXL_THREADS = 4


class Deployment:
    """x prefill and y decode servers with one connector, behind kvbridge's proxy."""

    def __init__(
        self,
        connector: str,
        shape: tuple[int, int],
        model: Path,
        logs: Path,
        nixl_threads: int = NIXL_THREADS,
    ) -> None:
        self.servers: list[Server] = []
        self.proxy: PDProxy | None = None
        prefills, decodes = shape
        roles = [("prefill", "kv_producer")] * prefills + [("decode", "kv_consumer")] * decodes

        # Decode first: each prefill instance's kvbridge bootstrap at a port the proxy knows.
        ports = [free_port() for _ in range(prefills)] if connector == STREAM else []

        def start(index: int) -> Server:
            name, role = roles[index]
            log = logs / f"{connector}-{prefills}p{decodes}d-{name}{index}.log"
            if connector != STREAM:
                transfer = transfer_config(connector, role, num_threads=nixl_threads)
            elif role == "kv_producer":
                transfer = kvbridge_config(role, "nixl", bootstrap_port=ports[index])
            else:
                transfer = kvbridge_config(role, "nixl")
            server = Server(model, transfer, log, environment=UNBOUND, arguments=DTYPE)
            self.servers.append(server)
            return server

        try:
            # Started at once (a start is mostly waiting on imports and the engine's set-up).
            with ThreadPoolExecutor(len(roles)) as pool:
                started = list(pool.map(start, range(len(roles))))
            urls = [server.url for server in started]
            bootstraps = [f"http://127.0.0.1:{port}" for port in ports]
            self.proxy = PDProxy(urls[:prefills], urls[prefills:], prefill_bootstrap=bootstraps)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.shutdown()
        for server in self.servers:
            server.close()


def run_client(
    url: str, model: Path, rate: float, options: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """vLLM's benchmark client against the proxy; its result file."""
    arguments = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(options.input_len),
        "--random-output-len",
        str(options.output_len),
        "--random-prefix-len",
        str(options.prefix_len),
        "--random-range-ratio",
        "0.25",
        "--num-prompts",
        str(options.prompts),
        "--request-rate",
        str(rate),
        "--burstiness",
        "1",
        "--seed",
        "0",
        "--ignore-eos",
        "--percentile-metrics",
        ",".join(KEYS),
        "--metric-percentiles",
        "50,99",
        "--goodput",
        f"ttft:{options.slo_ttft_ms}",
        f"tpot:{options.slo_tpot_ms}",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "120",
    ]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(
            [sys.executable, "-c", CLIENT, *arguments],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=1800,
        )
    return dict(json.loads(out.read_text()))


def row_of(
    result: dict[str, Any], proxy_s: list[float], proxy_first_s: list[float]
) -> dict[str, Any]:
    """A run's row: the client's figures and the proxy's own time per request, before the
    first byte (what it adds to TTFT) and in all (relaying every streamed chunk included)."""
    row = {
        f"{key}_{p}_ms": round(result[f"{'median' if p == 'p50' else 'p99'}_{key}_ms"], 1)
        for key in KEYS
        for p in ("p50", "p99")
    }
    row.update(
        completed=result["completed"],
        failed=result.get("failed", 0),
        request_throughput=round(result["request_throughput"], 3),
        output_throughput=round(result["output_throughput"], 1),
        goodput=round(result.get("request_goodput") or 0.0, 3),
    )
    for name, seconds in (("proxy_first", proxy_first_s), ("proxy", proxy_s)):
        ordered = sorted(seconds) or [0.0]
        row[f"{name}_p50_ms"] = round(1000 * statistics.median(ordered), 3)
        row[f"{name}_p99_ms"] = round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 3)
    return row


def measure(
    connector: str,
    deployment: str,
    model: Path,
    logs: Path,
    options: argparse.Namespace,
    rates: list[float],
) -> list[dict[str, Any]]:
    """One connector's deployment: a capacity run, then one run per rate (set from the
    capacity run if `rates` is empty: the first connector's)."""
    serving = Deployment(connector, DEPLOYMENTS[deployment], model, logs, options.nixl_threads)
    rows = []
    try:
        runs: list[float] = [float("inf"), *rates]
        index = 0
        while index < len(runs):
            rate = runs[index]
            assert serving.proxy is not None
            proxy = serving.proxy
            before = len(proxy.timings()[0])
            out = logs / f"{connector}-{deployment}-{rate:g}.json"
            result = run_client(serving.url, model, rate, options, out)
            own, before_first_byte = proxy.timings()
            row = row_of(result, own[before:], before_first_byte[before:])
            row.update(connector=connector, deployment=deployment, rate=rate)
            rows.append(row)
            print(
                f"{deployment} {connector:18} rate {rate:6g}: TTFT p50 {row['ttft_p50_ms']:8.1f}"
                f" p99 {row['ttft_p99_ms']:8.1f} ms, TPOT p50 {row['tpot_p50_ms']:6.1f} ms, "
                f"{row['request_throughput']:.2f} req/s, goodput {row['goodput']:.2f}, "
                f"proxy p50 {row['proxy_first_p50_ms']:.3f} ms to first byte, "
                f"{row['proxy_p50_ms']:.3f} ms in all, failed {row['failed']}",
                flush=True,
            )
            if rate == float("inf") and not rates:  # the first connector sets the rates
                capacity = row["request_throughput"]
                rates.extend(round(capacity * f, 3) for f in RATE_FRACTIONS)
                runs.extend(rates)
            index += 1
    finally:
        serving.close()
    return rows


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each kvbridge run over the best vLLM connector's run of the same deployment and rate
    (the lower TTFT p50)."""
    lines = []
    for row in rows:
        if row["connector"] in VLLM_CONNECTORS:
            continue
        theirs = [
            r
            for r in rows
            if r["connector"] in VLLM_CONNECTORS
            and (r["deployment"], r["rate"]) == (row["deployment"], row["rate"])
        ]
        if not theirs:
            continue
        best = min(theirs, key=lambda r: r["ttft_p50_ms"])
        lines.append(
            {
                "connector": row["connector"],
                "deployment": row["deployment"],
                "rate": row["rate"],
                "best_vllm": best["connector"],
                "ttft_p50_vs_best": round(row["ttft_p50_ms"] / best["ttft_p50_ms"], 2),
                "ttft_p99_vs_best": round(row["ttft_p99_ms"] / best["ttft_p99_ms"], 2),
                "throughput_vs_best": round(
                    row["request_throughput"] / best["request_throughput"], 2
                ),
            }
        )
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    deployments = sorted({row["deployment"] for row in rows})
    figure, axes = plt.subplots(
        len(deployments), 2, figsize=(11, 4 * len(deployments)), squeeze=False
    )
    for line, deployment in zip(axes, deployments, strict=True):
        for key, axis in zip(("ttft_p50_ms", "ttft_p99_ms"), line, strict=True):
            for connector in CONNECTORS:
                mine = sorted(
                    (r["request_throughput"], r[key])
                    for r in rows
                    if (r["connector"], r["deployment"]) == (connector, deployment)
                )
                if mine:
                    axis.plot(*zip(*mine, strict=True), marker="o", label=connector)
            axis.set_xlabel("achieved requests/s")
            axis.set_ylabel(key.replace("_", " ").replace(" ms", " (ms)"))
            axis.set_title(f"{deployment}: {key.split('_')[1]} TTFT vs load")
            axis.set_yscale("log")
            axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1P1D, 16 prompts, kvbridge-nixl and vllm-nixl"
    )
    parser.add_argument(
        "--deployments", nargs="+", choices=DEPLOYMENTS, help="default: both; quick 1p1d"
    )
    parser.add_argument("--connectors", nargs="+", choices=CONNECTORS)
    parser.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=[],
        help="requests/s (default: fractions of the measured capacity)",
    )
    parser.add_argument("--prompts", type=int, help="requests per run")
    parser.add_argument(
        "--input-len", type=int, help="mean prompt tokens (default 1024; quick 512)"
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prefix-len", type=int, default=256, help="tokens every prompt shares (prefix cache hits)"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--nixl-threads",
        type=int,
        default=NIXL_THREADS,
        help="NixlConnector's num_threads (UCX threads per instance)",
    )
    options = parser.parse_args()
    # The quick form fits in about 7 minutes here: 2P2D's four servers share two cores, and a
    # run past NixlConnector's saturation drains for minutes.
    options.deployments = options.deployments or (["1p1d"] if options.quick else list(DEPLOYMENTS))
    options.prompts = options.prompts or (16 if options.quick else 96)
    options.input_len = options.input_len or (512 if options.quick else 1024)
    connectors = list(
        options.connectors or (("kvbridge-nixl", "vllm-nixl") if options.quick else CONNECTORS)
    )
    if "kvbridge-mooncake" in connectors and importlib.util.find_spec("mooncake") is None:
        print("kvbridge-mooncake: Mooncake is not installed, skipped")
        connectors.remove("kvbridge-mooncake")
    RESULTS.mkdir(exist_ok=True)
    logs = RESULTS / "vllm-serve-logs"
    logs.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        model = make_model(Path(folder) / "model", layers=options.layers)
        for deployment in options.deployments:
            rates = list(options.rates)
            for connector in connectors:
                try:
                    rows += measure(connector, deployment, model, logs, options, rates)
                except (InstanceError, subprocess.SubprocessError, OSError, KeyError) as exc:
                    failures.append(f"{deployment} {connector}: {exc!r}"[:2000])
                    print(failures[-1], flush=True)
    summary = compare(rows)
    print("\n× best vLLM connector   deployment  rate   TTFT p50   p99   throughput")
    for line in summary:
        print(
            f"{line['connector']:20} {line['deployment']:10} {line['rate']:6g} "
            f"{line['ttft_p50_vs_best']:9.2f} {line['ttft_p99_vs_best']:5.2f} "
            f"{line['throughput_vs_best']:10.2f}   ({line['best_vllm']})"
        )
    document = {
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": round(time.monotonic() - began),
        "model": f"random Llama, {options.layers} layers, 8 KV heads × 128, float32, blocks of 32",
        "workload": {
            "prompts": options.prompts,
            "input_len": options.input_len,
            "output_len": options.output_len,
            "prefix_len": options.prefix_len,
            "range_ratio": 0.25,
            "burstiness": 1,
            "seed": 0,
        },
        "slo": {"ttft_ms": options.slo_ttft_ms, "tpot_ms": options.slo_tpot_ms},
        "rows": rows,
        "vs_best_vllm": summary,
        "failures": failures,
    }
    name = "vllm-serve" if options.quick else "vllm-serve-full"
    written = save(name, document)
    plotted = plot(rows, RESULTS / f"{name}.png")
    print(
        f"wrote {written}" + (f" and {name}.png" if plotted else "") + f" in {document['wall_s']} s"
    )
    if failures:
        raise SystemExit("runs that did not finish:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
