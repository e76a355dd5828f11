"""Real engines between two real processes: scattered pages arrive byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.engines import unavailable_reason
from kvbridge.engines.mooncake import default_submit_threads

PEER = Path(__file__).with_name("engine_peer.py")
GEOMETRY = dict(layer_ids=(0, 1, 2), page_size=4, total_kv_heads=2, head_dim=64)
TIMEOUT_S = 90
# Engines whose writes deliver a notification to the target after the data (kvbridge uses it
# where it exists; the control plane reports completion either way).
NOTIFIES = {"nixl": True, "mooncake": False}


class Peer:
    def __init__(self, prefix: list[str], *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [*prefix, sys.executable, str(PEER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def read(self) -> dict[str, object]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"peer exited with {self.process.wait(TIMEOUT_S)}"
        return json.loads(line)

    def send(self, **fields: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(fields) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def peers() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture(params=["nixl", "mooncake"])
def engine_prefix(request: pytest.FixtureRequest) -> tuple[str, list[str]]:
    """An installed engine, and the command prefix its processes run under: Mooncake binds
    wildcard listeners, so its peers share a private network namespace."""
    engine = str(request.param)
    reason = unavailable_reason(engine)
    if reason is not None:
        pytest.skip(f"{engine} cannot be used here: {reason}")
    prefix: list[str] = request.getfixturevalue("private_netns") if engine == "mooncake" else []
    return engine, prefix


def test_two_process_scattered_write(
    engine_prefix: tuple[str, list[str]], tmp_path: Path, peers: ExitStack
) -> None:
    engine, prefix = engine_prefix
    scattered_write(engine, prefix, tmp_path, peers)


def test_mooncake_batches_stay_within_its_per_peer_queue(
    private_netns: list[str], tmp_path: Path, peers: ExitStack
) -> None:
    """With Mooncake's TCP queue set to 16 blocks per peer, a write of 240 blocks goes as
    batches of at most 16 shared by the submit threads, and arrives whole."""
    reason = unavailable_reason("mooncake")
    if reason is not None:
        pytest.skip(f"mooncake cannot be used here: {reason}")
    limits = {
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16",
    }
    report = scattered_write("mooncake", private_netns, tmp_path, peers, limits)
    assert report["blocks"] == 40 * 6
    assert report["batch_blocks"] == 16 // default_submit_threads()


def test_mooncake_refuses_batches_beyond_its_per_peer_queue(private_netns: list[str]) -> None:
    reason = unavailable_reason("mooncake")
    if reason is not None:
        pytest.skip(f"mooncake cannot be used here: {reason}")
    code = (
        "from kvbridge.engines import create_engine\n"
        "create_engine('mooncake', 'x', options={'batch_blocks': '1024', "
        "'submit_threads': '2'})"
    )
    result = subprocess.run(
        [*private_netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "1024"},
    )
    assert result.returncode != 0
    assert (
        "2 submit thread(s) × batches of 1024 blocks exceed Mooncake's TCP queue of 1024 blocks "
        "per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER)"
        ": raise them or lower batch_blocks"
    ) in result.stderr


def scattered_write(
    engine: str,
    prefix: list[str],
    tmp_path: Path,
    peers: ExitStack,
    env: dict[str, str] | None = None,
) -> dict[str, object]:
    """Scattered pages from one process to another through the engine; the initiator's
    report once every byte was checked."""
    src_total, dst_total, count, seed = 48, 96, 40, 7
    out = tmp_path / "target.npz"
    target = Peer(prefix, engine, "target", str(dst_total), str(out), env=env)
    peers.callback(target.close)
    initiator = Peer(prefix, engine, "initiator", str(src_total), str(seed), env=env)
    peers.callback(initiator.close)
    target_info, initiator_info = target.read(), initiator.read()
    assert initiator_info["transport"]

    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(src_total)[:count]
    dst_pages = rng.permutation(dst_total)[:count]
    initiator.send(
        peer_endpoint=target_info["endpoint"],
        peer_kv=target_info["kv"],
        src_pages=src_pages.tolist(),
        dst_pages=dst_pages.tolist(),
    )
    report = initiator.read()
    assert report["ok"], report
    assert report["write_ends"] == (1 if engine == "mooncake" else 0)
    target.send(finish=True)
    assert target.read() == {"ok": True, "notified": NOTIFIES[engine], "unexpected": []}

    source = rank_cache(num_pages=src_total, seed=seed, **GEOMETRY)
    received = np.load(out)
    for index, array in enumerate(source.kv):
        expected = np.zeros((dst_total, *array.shape[1:]), dtype=array.dtype)
        expected[dst_pages] = array[src_pages]
        assert np.array_equal(received[f"arr_{index}"], expected), f"buffer {index}"
    return report
