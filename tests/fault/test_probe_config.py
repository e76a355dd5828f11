"""Issue 11, findings 3, 7 and 8, the way a user meets them: each in a real process.

- Buffers described by `KVArgs.from_numpy` are temporaries the caller does not keep: the
  bytes must still arrive right (the description keeps its arrays alive).
- Impossible configurations are refused at once with the reason in words.
- Creating a NIXL engine leaves the host's logging alone (a FileHandler keeps writing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from real_engine import ENGINE, require_engine

require_engine()

TEMPORARY_BUFFERS = textwrap.dedent(
    """
    import ctypes, gc, time
    import numpy as np
    from kvbridge.cache import KVArgs
    from kvbridge.config import ManagerConfig
    from kvbridge.decode import DecodeManager
    from kvbridge.prefill import PrefillManager
    from kvbridge.wire import KVLayout, KVPoll

    def kv(seed):  # four [16 pages, 4 tokens, 2 heads, 8] uint8 arrays, nobody keeps them
        rng = np.random.default_rng(seed)
        return [rng.integers(0, 256, (16, 4, 2, 8), dtype=np.uint8) for _ in range(4)]

    geometry = dict(kv_layout=KVLayout.MHA, total_kv_heads=2)
    src_args = KVArgs.from_numpy(kv(1), aux=[np.arange(64, dtype=np.uint8).reshape(4, 16)],
                                 **geometry)
    dst_args = KVArgs.from_numpy([np.zeros((16, 4, 2, 8), np.uint8) for _ in range(4)],
                                 aux=[np.zeros((4, 16), np.uint8)], **geometry)
    for _ in range(50):  # churn the allocator where the temporaries were
        junk = [np.full((16, 4, 2, 8), 0xEE, np.uint8) for _ in range(8)]
    gc.collect()
    prefill = PrefillManager(src_args, ManagerConfig(engine="{engine}", run_bootstrap=True))
    decode = DecodeManager(dst_args, ManagerConfig(engine="{engine}",
                                                   bootstrap_url=prefill.bootstrap_url))
    sender, receiver = prefill.sender(1), decode.receiver(1)
    receiver.init([2, 3], aux_index=1)
    sender.send([4, 5], last=True, aux_index=2)
    deadline = time.monotonic() + 10
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.poll() == KVPoll.Success, receiver.failure_reason
    page = 4 * 2 * 8
    expected = kv(1)
    for index, buffer in enumerate(dst_args.kv_buffers):
        got = np.frombuffer(ctypes.string_at(buffer.ptr, buffer.length), np.uint8)
        got = got.reshape(16, 4, 2, 8)
        np.testing.assert_array_equal(got[[2, 3]], expected[index][[4, 5]])
    aux = np.frombuffer(ctypes.string_at(dst_args.aux_buffers[0].ptr, 64), np.uint8)
    np.testing.assert_array_equal(aux[16:32], np.arange(32, 48))
    receiver.clear(); sender.clear()
    decode.close(); prefill.close()
    print("bytes right")
    """
).format(engine=ENGINE)

HOST_LOGGING = textwrap.dedent(
    """
    import logging, sys
    handler = logging.FileHandler(sys.argv[1])
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.info("before the engine")
    raise_exceptions = logging.raiseExceptions
    from kvbridge.engines import create_engine, unavailable_reason
    assert unavailable_reason("{engine}") is None
    engine = create_engine("{engine}", "host-logging", "127.0.0.1")
    logging.info("after the engine")
    engine.close()
    assert not handler.stream.closed, "the host's FileHandler was closed"
    assert logging.raiseExceptions == raise_exceptions
    """
).format(engine=ENGINE)


def run(script: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout_s
    )


def test_temporary_arrays_stay_alive_while_registered() -> None:
    done = run(TEMPORARY_BUFFERS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bytes right" in done.stdout


def test_creating_an_engine_leaves_the_hosts_logging_alone(tmp_path: Path) -> None:
    log_file = tmp_path / "host.log"
    done = run(HOST_LOGGING, str(log_file))
    assert done.returncode == 0, done.stderr[-3000:]
    assert log_file.read_text().splitlines() == ["before the engine", "after the engine"]


def test_impossible_demo_configurations_are_refused_at_once_in_words() -> None:
    cases = {
        ("--prefill-tp", "3", "--decode-tp", "4"): "8 KV heads do not divide over TP 3",
        ("--prefill-tp", "1", "--decode-tp", "3"): "8 KV heads do not divide over TP 3",
        ("--requests", "100000", "--tokens", "8192"): "GiB is available",
    }
    if not shutil.which("nvidia-smi"):
        cases["--memory", "cuda"] = "--memory cuda needs"
    for args, reason in cases.items():
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "kvbridge", "demo", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert reason in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
        assert time.monotonic() - started < 20


def test_kvpoll_prints_its_name() -> None:
    from kvbridge.wire import KVPoll

    assert str(KVPoll.Failed) == "Failed"
    assert f"state {KVPoll.Success}" == "state Success"
    assert int(KVPoll.Failed) == 0
