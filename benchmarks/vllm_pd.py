"""kvbridge's vLLM connector against vLLM's own NixlConnector, on identical work in one run.

    .venv-vllm/bin/python benchmarks/vllm_pd.py [--quick] [--layers N] [--rounds N]

Same deployment (a prefill and a decode instance of vLLM 0.32's CPU build, separate processes),
same random model with Llama-3-8B's per-layer KV geometry (8 KV heads × 128) and a few layers,
same prompts. Each connector's deployment runs alone, one after another (with `--interleave`:
all at once, per workload their rounds interleaved, the order alternating from round to round,
the others' instances stopped with SIGSTOP meanwhile — NixlConnector's keep a thread each busy
between requests — and resumed a second before their round). A deployment is warmed up by one
small request (the instances' first contact is not steady state); per workload (prompt length ×
concurrent requests) one untimed round, then at least `--rounds` timed ones and at least 64
timed requests; in each the prefill batch runs first (max_tokens 1), then the decode batch, all
requests at once. Every round sends the same prompts: prefill computes them once (round 0) and
serves the later rounds from its prefix cache — its compute is not what is measured — while
decode drops its prefix cache before each round, so it loads every block anew. Over the timed
rounds' requests: decode time to first token p50/p99 (from the request's arrival at decode to
its first token: the KV transfer plus vLLM's first compute step), KV in place p50/p99 (from the
arrival to the step in which vLLM's scheduler hears the KV is loaded: the transfer plane's
part, seen the same way for every connector), KV GB/s (the batch's KV bytes over the median
decode-batch wall), the wall itself; greedy tokens checked equal between the connectors. Writes
bench-results/vllm.json and bench-results/vllm.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm_compat"))

from vllm_harness import Instance, InstanceError, kvbridge_config, make_model, nixl_config, prompt

RESULTS = Path("bench-results")
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2
CONNECTORS = ("kvbridge-nixl", "kvbridge-mooncake", "vllm-nixl")
# NixlConnector's prefill frees a request's blocks 30 s after it ended unless decode has
# pulled them or renewed the lease; round 0 here computes a whole batch of long prompts first
# (minutes on this CPU host), so the first requests' leases would end before decode starts.
NIXL_LEASE_S = 3600
# Round 0's prefill of the largest batch takes minutes here.
GENERATE_TIMEOUT_S = 1800.0


def transfer_config(connector: str, role: str) -> dict[str, Any]:
    if connector == "vllm-nixl":
        return nixl_config(role, kv_lease_duration=NIXL_LEASE_S)
    return kvbridge_config(role, connector.removeprefix("kvbridge-"))


def failed(outputs: list[dict[str, Any]]) -> int:
    return sum(1 for output in outputs if output["ttft_s"] is None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class RunFailed(Exception):
    """A connector's run could not finish; the other connectors go on."""


# Timed requests per connector and workload, at least (more rounds where fewer run at once):
# a p50 over 24 requests moved by a tenth from one run to the next here.
MIN_TIMED_REQUESTS = 64
# After a deployment is let go on (SIGCONT): two of kvbridge's heartbeat intervals.
RESUME_SETTLE_S = 1.0


def kv_bytes(length: int, concurrent: int, layers: int) -> int:
    return concurrent * length * layers * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES


class Deployment:
    """One connector's prefill and decode instance, warmed up, and what its rounds measured."""

    def __init__(
        self, connector: str, model: Path, logs: Path, workloads: list[tuple[int, int]],
        layers: int,
    ) -> None:  # fmt: skip
        self.connector = connector
        self.logs = logs
        largest = max(length * concurrent for length, concurrent in workloads)
        longest = max(length for length, _ in workloads)
        env = {"KVBRIDGE_TEST_KV_BYTES": str(int(1.5 * kv_bytes(largest, 1, layers))),
               "KVBRIDGE_TEST_MAX_MODEL_LEN": str(longest + 64)}  # fmt: skip
        self.prefill = Instance(model, transfer_config(connector, "kv_producer"),
                                logs / f"{connector}-prefill.log", env=env)  # fmt: skip
        try:
            self.decode = Instance(model, transfer_config(connector, "kv_consumer"),
                                   logs / f"{connector}-decode.log", env=env)  # fmt: skip
        except BaseException:
            self.prefill.close()
            raise
        self.samples: dict[str, list[Any]] = {}
        self.prefill_first_s = 0.0
        try:
            # One small request first: the first contact between the instances (handshakes,
            # registration, engine connections) is not what a request in steady state pays.
            warm = [prompt(40, 7)]
            warmed = self.prefill.generate(warm, 1, [{"do_remote_decode": True}])["outputs"]
            self.decode.generate(warm, 2, [warmed[0]["kv_transfer_params"]])
        except BaseException:
            self.close()
            raise

    def pause(self, paused: bool) -> None:
        """Stop both instances (SIGSTOP) while another connector runs, or let them go on: an
        idle instance is not always idle (NixlConnector's keep a thread each busy between
        requests, about 0.9 of a core here), and the others' rounds must not pay for it."""
        for instance in (self.prefill, self.decode):
            instance.signal(signal.SIGSTOP if paused else signal.SIGCONT)
        if not paused:
            # A serving deployment is never frozen: its liveness messages flow while it idles.
            # Let them flow again before a round (a round right after SIGCONT would also pay
            # for catching up: kvbridge renews the write lease that ran out while stopped).
            time.sleep(RESUME_SETTLE_S)

    def start_workload(self) -> None:
        self.samples = {"ttft": [], "kv_ready": [], "walls": [], "tokens_out": []}
        self.prefill_first_s = 0.0  # round 0: prefill computes the batch (later: cached)

    def round(self, length: int, concurrent: int, timed: bool) -> None:
        """One round: the prefill batch, then the decode batch with every request at once."""
        prompts = [prompt(length, 1000 * length + i) for i in range(concurrent)]
        params = [{"do_remote_decode": True}] * concurrent
        prefilled = self.prefill.generate(prompts, 1, params, GENERATE_TIMEOUT_S)
        if not timed:
            self.prefill_first_s = prefilled["wall_s"]
        # Nothing may come from decode's own prefix cache: every block is loaded.
        if not self.decode.call("reset_prefix_cache")["reset"]:
            raise RunFailed("decode could not drop its prefix cache")
        began = time.perf_counter()
        decoded = self.decode.generate(
            prompts, 4, [output["kv_transfer_params"] for output in prefilled["outputs"]],
            GENERATE_TIMEOUT_S,
        )["outputs"]  # fmt: skip
        wall = time.perf_counter() - began
        unanswered = failed(decoded)
        if unanswered:
            raise RunFailed(f"{unanswered} of {concurrent} decode requests of {length} tokens "
                            f"ended without a token; logs in {self.logs}")  # fmt: skip
        # Prefill frees the blocks once decode has them (NixlConnector: once notified).
        self.prefill.wait_for(lambda s: s["running"] == 0, timeout_s=30)
        if not timed:
            return
        missing = sum(1 for output in decoded if output["kv_ready_s"] is None)
        if missing:
            raise RunFailed(f"vLLM never heard that {missing} loads ended")
        self.samples["ttft"] += [output["ttft_s"] for output in decoded]
        self.samples["kv_ready"] += [output["kv_ready_s"] for output in decoded]
        self.samples["walls"].append(wall)
        self.samples["tokens_out"] += [output["tokens"] for output in decoded]

    def row(self, length: int, concurrent: int, layers: int, rounds: int) -> dict[str, Any]:
        ttft, kv_ready = self.samples["ttft"], self.samples["kv_ready"]
        wall = statistics.median(self.samples["walls"])
        return {
            "connector": self.connector, "tokens": length, "concurrent": concurrent,
            "rounds": rounds,
            "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
            "kv_ready_p50_ms": round(1000 * percentile(kv_ready, 0.5), 1),
            "kv_ready_p99_ms": round(1000 * percentile(kv_ready, 0.99), 1),
            "decode_wall_s": round(wall, 3),
            "kv_gbps": round(kv_bytes(length, concurrent, layers) / wall / 1e9, 3),
            "prefill_first_s": round(self.prefill_first_s, 1),
            "tokens_out": self.samples["tokens_out"],
        }  # fmt: skip

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def measure(
    connectors: list[str], model: Path, logs: Path, workloads: list[tuple[int, int]],
    layers: int, rounds: int, rows: list[dict[str, Any]], failures: list[str],
) -> None:  # fmt: skip
    """The connectors' deployments at once, and per workload their rounds interleaved (the
    order alternating from round to round; the others stopped meanwhile), so that a machine
    whose speed drifts from minute to minute moves every connector alike; one connector: its
    rounds alone. Appends a row per connector and workload to `rows` (as each workload ends,
    so that a later failure keeps them); a connector that fails is reported in `failures` and
    the others go on."""
    interleaved = len(connectors) > 1

    def fail(deployment: Deployment, error: Exception) -> None:
        failures.append(f"{deployment.connector}: {error}".splitlines()[0])
        print(f"{failures[-1]} (logs in {logs})", flush=True)
        deployments.remove(deployment)
        deployment.close()

    deployments: list[Deployment] = []
    try:
        for connector in connectors:
            try:
                deployments.append(Deployment(connector, model, logs, workloads, layers))
                if interleaved:
                    deployments[-1].pause(True)
            except (RunFailed, InstanceError) as error:
                failures.append(f"{connector}: {error}".splitlines()[0])
                print(f"{failures[-1]} (logs in {logs})", flush=True)
        for length, concurrent in workloads:
            timed_rounds = max(rounds, math.ceil(MIN_TIMED_REQUESTS / concurrent))
            for deployment in deployments:
                deployment.start_workload()
            # Round 0 is not counted: it is the first use of that many blocks on both sides
            # (first-touch costs, vLLM's shapes); each later round is the same work again.
            for round_index in range(timed_rounds + 1):
                order = deployments if round_index % 2 == 0 else deployments[::-1]
                for deployment in list(order):
                    if interleaved:
                        deployment.pause(False)
                    try:
                        deployment.round(length, concurrent, timed=round_index > 0)
                    except (RunFailed, InstanceError) as error:
                        fail(deployment, error)
                    else:
                        if interleaved:
                            deployment.pause(True)
            for deployment in deployments:
                rows.append(deployment.row(length, concurrent, layers, timed_rounds))
                row = rows[-1]
                print(f"{deployment.connector:18} {length:5} tokens × {concurrent:2}: TTFT p50 "
                      f"{row['ttft_p50_ms']:7.1f} ms, p99 {row['ttft_p99_ms']:7.1f} ms; KV in "
                      f"place p50 {row['kv_ready_p50_ms']:6.1f} ms, p99 "
                      f"{row['kv_ready_p99_ms']:6.1f} ms; {row['kv_gbps']:.2f} GB/s (prefill "
                      f"computed the batch in {row['prefill_first_s']:.0f} s)",
                      flush=True)  # fmt: skip
    finally:
        for deployment in deployments:
            deployment.close()


METRICS = (
    ("ttft_p50_ms", "decode TTFT p50 (ms)"), ("ttft_p99_ms", "decode TTFT p99 (ms)"),
    ("kv_ready_p50_ms", "KV in place p50 (ms)"), ("kv_ready_p99_ms", "KV in place p99 (ms)"),
)  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = sorted({(row["tokens"], row["concurrent"]) for row in rows})
    labels = [f"{tokens}×{concurrent}" for tokens, concurrent in workloads]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    width = 0.8 / len(CONNECTORS)
    for (key, title), axis in zip(METRICS, axes.flat, strict=True):
        for index, connector in enumerate(CONNECTORS):
            mine = {(r["tokens"], r["concurrent"]): r for r in rows if r["connector"] == connector}
            if mine:
                xs = [i + index * width for i in range(len(workloads))]
                axis.bar(xs, [mine[w][key] for w in workloads], width, label=connector)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], labels)
        axis.set_xlabel("prompt tokens × concurrent requests")
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 2k tokens × 8 only")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=3,
        help=f"timed rounds per workload, at least (and at least {MIN_TIMED_REQUESTS} requests)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", action="store_true",
        help="all deployments at once, rounds interleaved (default: one connector after another)",
    )  # fmt: skip
    parser.add_argument(
        "--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS),
        help="which connectors to run (default: all; the ratios need vllm-nixl)",
    )  # fmt: skip
    options = parser.parse_args()
    layers = options.layers
    workloads = (
        [(1024, 8), (2048, 8)] if options.quick else [(1024, 8), (1024, 32), (4096, 8), (8192, 8)]
    )
    RESULTS.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    logs = RESULTS / "vllm-logs"  # kept: a failed run says why in them
    logs.mkdir(exist_ok=True)
    connectors = list(options.connectors)
    if "kvbridge-mooncake" in connectors and importlib.util.find_spec("mooncake") is None:
        print("kvbridge-mooncake: Mooncake is not installed, skipped")
        connectors.remove("kvbridge-mooncake")
    with tempfile.TemporaryDirectory() as folder:
        model = make_model(Path(folder) / "model", layers=layers)
        # Interleaved, or each connector's deployment alone, one after the other.
        groups = [connectors] if options.interleave else [[c] for c in connectors]
        for group in groups:
            measure(group, model, logs, workloads, layers, options.rounds, rows, failures)
    baseline = {(r["tokens"], r["concurrent"]): r for r in rows if r["connector"] == "vllm-nixl"}
    summary = []
    for row in rows:
        base = baseline.get((row["tokens"], row["concurrent"]))
        if base is None or row["connector"] == "vllm-nixl":
            continue
        line: dict[str, Any] = {
            "connector": row["connector"], "tokens": row["tokens"],
            "concurrent": row["concurrent"],
        }  # fmt: skip
        for key, _ in METRICS:
            line[key.removesuffix("_ms") + "_vs_nixl"] = round(row[key] / base[key], 2)
        line["tokens_equal"] = row["tokens_out"] == base["tokens_out"]
        summary.append(line)
    print("\n× NixlConnector     workload   TTFT p50   p99   KV in place p50   p99   tokens equal")
    for line in summary:
        print(f"{line['connector']:18} {line['tokens']:5}×{line['concurrent']:<3}   "
              f"{line['ttft_p50_vs_nixl']:8.2f} {line['ttft_p99_vs_nixl']:5.2f} "
              f"{line['kv_ready_p50_vs_nixl']:17.2f} {line['kv_ready_p99_vs_nixl']:5.2f}   "
              f"{line['tokens_equal']}")  # fmt: skip
    for row in rows:
        del row["tokens_out"]
    document = {
        "date": time.strftime("%Y-%m-%d"), "layers": layers, "block_size": 32,
        "rounds": options.rounds,
        "model": f"random Llama, {layers} layers, 8 KV heads × 128, bf16",
        "rows": rows, "vs_nixl_connector": summary,
    }  # fmt: skip
    (RESULTS / "vllm.json").write_text(json.dumps(document, indent=2) + "\n")
    plotted = plot(rows, RESULTS / "vllm.png")
    print(f"wrote {RESULTS / 'vllm.json'}" + (f" and {RESULTS / 'vllm.png'}" if plotted else ""))
    if failures:
        raise SystemExit("runs that did not finish:\n" + "\n".join(failures))
    if not all(line["tokens_equal"] for line in summary):
        raise SystemExit("tokens differ between the connectors")


if __name__ == "__main__":
    main()
