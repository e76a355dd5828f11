"""kvbridge's vLLM connector against vLLM's own NixlConnector, on identical work in one run.

    .venv-vllm/bin/python benchmarks/vllm_pd.py [--quick] [--family F] [--layers N] [--rounds N]

Same deployment (a prefill and a decode instance of vLLM 0.32's CPU build, separate processes),
same random model, same prompts. The model is one family (`--family`; the tests' models,
tests/vllm_compat/vllm_harness.py): `llama` (Llama-3-8B's per-layer KV geometry, 8 KV heads ×
128, a few layers), `mla` (DeepSeek-V2-shaped MLA), `sliding` (Gemma-3-shaped sliding window
and full attention through vLLM's hybrid KV cache manager), `mamba` (Granite-4-hybrid-shaped
Mamba-2 and attention; prefix caching off, as vLLM's CPU Mamba-2 mixer needs, so prefill
computes every round). Each connector's deployment runs alone, one after another (with
`--interleave`: all at once, per workload their rounds interleaved, the order alternating from
round to round, the others' instances stopped with SIGSTOP meanwhile — NixlConnector's keep a
thread each busy between requests — and resumed a second before their round). A deployment is
warmed up by one small request (the instances' first contact is not steady state); per
workload (prompt length × concurrent requests) one untimed round, then at least `--rounds`
timed ones and at least 64 timed requests; in each the prefill batch runs first (max_tokens 1),
then the decode batch, all requests at once. Every round sends the same prompts: prefill
computes them once (round 0) and serves the later rounds from its prefix cache — its compute
is not what is measured — while decode drops its prefix cache before each round, so it loads
every block anew. Over the timed rounds' requests: decode time to first token p50/p99 (from
the request's arrival at decode to its first token: the KV transfer plus vLLM's first compute
step), KV in place p50/p99 (from the arrival to the step in which vLLM's scheduler hears the KV
is loaded: the transfer plane's part, seen the same way for every connector), KV GB/s (the
batch's KV bytes over the median decode-batch wall), the wall itself; greedy tokens checked
equal between the connectors. Writes bench-results/vllm.json and vllm.png (another family:
vllm-FAMILY.json and .png; without `--quick`, vllm-full.json or vllm-FAMILY-full.json).
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

from vllm_harness import (
    BLOCK_SIZE,
    FAMILY_ENV,
    Instance,
    InstanceError,
    kvbridge_config,
    make_model,
    nixl_config,
    prompt,
)

from kvbridge_tools.bench_results import save

RESULTS = Path("bench-results")
CONNECTORS = ("kvbridge-nixl", "kvbridge-mooncake", "vllm-nixl", "vllm-nixl-push")
BASELINE = "vllm-nixl"
FAMILIES = ("llama", "mla", "sliding", "mamba")
# vLLM's CPU MLA decode of the random MLA model flips near ties with the make-up of the decode
# batch, and which loads end in one step differs between connectors: MLA's tokens are reported,
# not required equal (tests/vllm_compat/test_model_families.py checks MLA's bytes and, one
# prompt at a time, its tokens against NixlConnector's).
TOKENS_REPORTED_ONLY = ("mla",)
# NixlConnector's prefill frees a request's blocks 30 s after it ended unless decode has
# pulled them or renewed the lease; round 0 here computes a whole batch of long prompts first
# (minutes on this CPU host), so the first requests' leases would end before decode starts.
NIXL_LEASE_S = 3600
# Round 0's prefill of the largest batch takes minutes here.
GENERATE_TIMEOUT_S = 1800.0


def transfer_config(connector: str, role: str, **nixl: Any) -> dict[str, Any]:
    """A connector's kv_transfer_config; `nixl`: more of NixlConnector's extra config."""
    if connector == "vllm-nixl":
        return nixl_config(role, kv_lease_duration=NIXL_LEASE_S, **nixl)
    if connector == "vllm-nixl-push":  # NixlConnector's push mode: prefill writes into decode
        return {
            **nixl_config(role, kv_lease_duration=NIXL_LEASE_S, **nixl),
            "kv_connector": "NixlPushConnector",
        }
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


BF16 = 2


def kv_bytes(model: Path, length: int, concurrent: int) -> int:
    """The KV (and state) bytes a batch of `concurrent` prompts of `length` tokens moves, from
    the model's own config.json: MLA's latent per layer, K and V of each attention layer (a
    sliding-window layer's window only, in whole blocks), each Mamba-2 layer's conv and SSM
    state."""
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    if "kv_lora_rank" in config:  # MLA: one latent per token and layer
        per_token = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return concurrent * length * layers * per_token * BF16
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    attention = 2 * config["num_key_value_heads"] * head_dim * BF16  # per token and layer
    per_request = 0
    for kind in config.get("layer_types") or ["full_attention"] * layers:
        if kind in ("mamba", "linear_attention"):  # transformers names Mamba layers either way
            inner = config["mamba_expand"] * config["hidden_size"]
            conv = (inner + 2 * config["mamba_n_groups"] * config["mamba_d_state"]) * (
                config["mamba_d_conv"] - 1
            )
            ssm = config["mamba_n_heads"] * config["mamba_d_head"] * config["mamba_d_state"]
            per_request += (conv + ssm) * BF16
        elif kind == "sliding_attention":  # the window's blocks, the last one partly filled
            window = (-(-config["sliding_window"] // BLOCK_SIZE) + 1) * BLOCK_SIZE
            per_request += attention * min(length, window)
        else:
            per_request += attention * length
    return concurrent * per_request


class Deployment:
    """One connector's prefill and decode instance, warmed up, and what its rounds measured."""

    def __init__(
        self,
        connector: str,
        model: Path,
        logs: Path,
        workloads: list[tuple[int, int]],
        layers: int,
        family: str,
    ) -> None:
        self.connector = connector
        self.logs = logs
        self.model = model
        largest = max(length * concurrent for length, concurrent in workloads)
        longest = max(length for length, _ in workloads)
        # Room for the largest batch, with the full-length KV every layer would need (a hybrid
        # model's groups share one pool of pages), at least vLLM's default here.
        full = 2 * 8 * 128 * BF16 * layers  # per token: Llama's geometry, the largest here
        kv_room = max(256 << 20, int(1.5 * largest * full))
        env = {
            **FAMILY_ENV[family],
            "KVBRIDGE_TEST_KV_BYTES": str(kv_room),
            "KVBRIDGE_TEST_MAX_MODEL_LEN": str(longest + 64),
        }
        self.prefill = Instance(
            model,
            transfer_config(connector, "kv_producer"),
            logs / f"{connector}-prefill.log",
            env=env,
        )
        try:
            self.decode = Instance(
                model,
                transfer_config(connector, "kv_consumer"),
                logs / f"{connector}-decode.log",
                env=env,
            )
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
            prompts,
            4,
            [output["kv_transfer_params"] for output in prefilled["outputs"]],
            GENERATE_TIMEOUT_S,
        )["outputs"]
        wall = time.perf_counter() - began
        unanswered = failed(decoded)
        if unanswered:
            raise RunFailed(
                f"{unanswered} of {concurrent} decode requests of {length} tokens "
                f"ended without a token; logs in {self.logs}"
            )
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

    def row(self, length: int, concurrent: int, rounds: int) -> dict[str, Any]:
        ttft, kv_ready = self.samples["ttft"], self.samples["kv_ready"]
        wall = statistics.median(self.samples["walls"])
        return {
            "connector": self.connector,
            "tokens": length,
            "concurrent": concurrent,
            "rounds": rounds,
            "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
            "kv_ready_p50_ms": round(1000 * percentile(kv_ready, 0.5), 1),
            "kv_ready_p99_ms": round(1000 * percentile(kv_ready, 0.99), 1),
            "decode_wall_s": round(wall, 3),
            "kv_gbps": round(kv_bytes(self.model, length, concurrent) / wall / 1e9, 3),
            "prefill_first_s": round(self.prefill_first_s, 1),
            "tokens_out": self.samples["tokens_out"],
        }

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def measure(
    connectors: list[str],
    model: Path,
    logs: Path,
    workloads: list[tuple[int, int]],
    layers: int,
    family: str,
    rounds: int,
    rows: list[dict[str, Any]],
    failures: list[str],
) -> None:
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
                deployments.append(Deployment(connector, model, logs, workloads, layers, family))
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
                rows.append(deployment.row(length, concurrent, timed_rounds))
                row = rows[-1]
                print(
                    f"{deployment.connector:18} {length:5} tokens × {concurrent:2}: TTFT p50 "
                    f"{row['ttft_p50_ms']:7.1f} ms, p99 {row['ttft_p99_ms']:7.1f} ms; KV in "
                    f"place p50 {row['kv_ready_p50_ms']:6.1f} ms, p99 "
                    f"{row['kv_ready_p99_ms']:6.1f} ms; {row['kv_gbps']:.2f} GB/s (prefill "
                    f"computed the batch in {row['prefill_first_s']:.0f} s)",
                    flush=True,
                )
    finally:
        for deployment in deployments:
            deployment.close()


METRICS = (
    ("ttft_p50_ms", "decode TTFT p50 (ms)"),
    ("ttft_p99_ms", "decode TTFT p99 (ms)"),
    ("kv_ready_p50_ms", "KV in place p50 (ms)"),
    ("kv_ready_p99_ms", "KV in place p99 (ms)"),
)


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


MODELS = {
    "llama": "random Llama, {layers} layers, 8 KV heads × 128, bf16, blocks of 32",
    "mla": "random DeepSeek-V2-shaped MLA, 4 dense layers, latent 512 + 64, bf16, CPU_MLA "
    "blocks of 16, prefix caching off (vLLM's CPU MLA turns it off)",
    "sliding": "random Gemma-3-shaped, 3 sliding-window layers (window 64) + 1 full, 4 KV heads "
    "× 128, bf16, blocks of 32, vLLM's hybrid KV cache manager",
    "mamba": "random Granite-4-hybrid-shaped, 2 Mamba-2 + 2 attention layers, bf16, block size "
    "vLLM's choice, vLLM's hybrid KV cache manager, prefix caching off",
}


def workloads_for(family: str, quick: bool) -> list[tuple[int, int]]:
    if family != "llama":  # vLLM's CPU Mamba-2 mixer and MLA decode: prompts up to ~2k here
        return [(1024, 8)] if quick else [(1024, 8), (1024, 32), (2048, 8)]
    return [(1024, 8), (2048, 8)] if quick else [(1024, 8), (1024, 32), (4096, 8), (8192, 8)]


def results_name(family: str, quick: bool) -> str:
    """`vllm`, `vllm-mla`, ...: the quick form's (what `make bench` runs); `-full` after it for
    the whole one, so that neither overwrites the other's figures."""
    name = "vllm" if family == "llama" else f"vllm-{family}"
    return name if quick else f"{name}-full"


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each connector's row over NixlConnector's for the same workload."""
    baseline = {(r["tokens"], r["concurrent"]): r for r in rows if r["connector"] == BASELINE}
    summary = []
    for row in rows:
        base = baseline.get((row["tokens"], row["concurrent"]))
        if base is None or row["connector"] == BASELINE:
            continue
        line: dict[str, Any] = {
            "connector": row["connector"],
            "tokens": row["tokens"],
            "concurrent": row["concurrent"],
        }
        for key, _ in METRICS:
            line[key.removesuffix("_ms") + "_vs_nixl"] = round(row[key] / base[key], 2)
        line["tokens_equal"] = row["tokens_out"] == base["tokens_out"]
        summary.append(line)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="llama: 1k and 2k tokens × 8 only; other families 1k × 8",
    )
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="the model family")
    parser.add_argument("--layers", type=int, default=4, help="llama's layers")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help=f"timed rounds per workload, at least (and at least {MIN_TIMED_REQUESTS} requests)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="all deployments at once, rounds interleaved (default: one connector after another)",
    )
    parser.add_argument(
        "--connectors",
        nargs="+",
        choices=CONNECTORS,
        default=[c for c in CONNECTORS if c != "vllm-nixl-push"],
        help="which connectors to run (default: all but vllm-nixl-push; the ratios need vllm-nixl)",
    )
    options = parser.parse_args()
    family = options.family
    layers = options.layers if family == "llama" else 4
    workloads = workloads_for(family, options.quick)
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
        model = make_model(Path(folder) / "model", layers=layers, family=family)
        # Interleaved, or each connector's deployment alone, one after the other.
        groups = [connectors] if options.interleave else [[c] for c in connectors]
        for group in groups:
            measure(group, model, logs, workloads, layers, family, options.rounds, rows, failures)
    summary = compare(rows)
    print(
        f"\n{family}: × NixlConnector     workload   TTFT p50   p99   KV in place p50   p99   "
        "tokens equal"
    )
    for line in summary:
        print(
            f"{line['connector']:18} {line['tokens']:5}×{line['concurrent']:<3}   "
            f"{line['ttft_p50_vs_nixl']:8.2f} {line['ttft_p99_vs_nixl']:5.2f} "
            f"{line['kv_ready_p50_vs_nixl']:17.2f} {line['kv_ready_p99_vs_nixl']:5.2f}   "
            f"{line['tokens_equal']}"
        )
    for row in rows:
        del row["tokens_out"]
    document = {
        "date": time.strftime("%Y-%m-%d"),
        "family": family,
        "layers": layers,
        "rounds": options.rounds,
        "model": MODELS[family].format(layers=layers),
        "rows": rows,
        "vs_nixl_connector": summary,
        "failures": failures,
    }
    name = results_name(family, options.quick)
    written = save(name, document)
    plotted = plot(rows, RESULTS / f"{name}.png")
    print(f"wrote {written}" + (f" and {RESULTS / name}.png" if plotted else ""))
    if failures:
        raise SystemExit("runs that did not finish:\n" + "\n".join(failures))
    if family not in TOKENS_REPORTED_ONLY and not all(line["tokens_equal"] for line in summary):
        raise SystemExit("tokens differ between the connectors")


if __name__ == "__main__":
    main()
