"""kvbridge live beside sglang 0.5.23's real PD transfer layer, over Mooncake TCP, both ways:
a kvbridge decode rank receives rooms from sglang's own prefill (`MooncakeKVManager`, its
senders and bootstrap server; live_sglang_prefill.py), and kvbridge prefill ranks serve
sglang's own decode (its manager and receivers, asking kvbridge's bootstrap;
live_sglang_decode.py); every byte checked, each scenario in a network namespace of its own
(root only)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here (tests/sglang_compat runs in .venv-sglang)",
        allow_module_level=True,
    )

from kvbridge_tools.bench import json_in_private_netns, private_netns_unavailable

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    private_netns_unavailable() is not None, reason=str(private_netns_unavailable())
)


BACKENDS = pytest.mark.parametrize("backend", ["mooncake", "nixl"])


def scenario(script: str = "live_sglang_prefill.py", **spec: Any) -> dict[str, Any]:
    report: dict[str, Any] = json_in_private_netns(
        [str(HERE / script), json.dumps(spec)], python=sys.executable
    )
    # Nothing kvbridge received was unreadable or ignored, nothing native went to sglang.
    channel = report["channel"]
    assert (channel["malformed"], channel["refused_native"], channel["handler_errors"]) == (0, 0, 0)
    assert report["ignored"] == 0
    if report["decode"] != "no report":  # a decode that was killed reports nothing
        assert report["sentinel_kept"], "a page no room asked for was written"
    return report


@BACKENDS
def test_a_kvbridge_decode_receives_every_byte_from_sglangs_prefill(backend: str) -> None:
    report = scenario(rooms=6, pages_per_room=8, chunks=2, backend=backend)
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 6
    assert set(report["prefill"].values()) == {"Success"}


@BACKENDS
def test_two_decode_ranks_each_get_their_heads_from_one_sglang_prefill_rank(backend: str) -> None:
    # sglang's prefill (TP 1) awaits two requests per room and writes each decode rank its
    # half of the heads, token by token (its send_kvcache_slice): every byte checked per rank.
    report = scenario(rooms=3, decode_tp=2, backend=backend, timeout_s=20)
    if backend == "nixl":
        # sglang's NIXL prefill moves head slices only into GPU memory: toward host memory
        # its listener would die at the registration, so kvbridge refuses before it.
        for outcome in report["decode"].values():
            assert outcome["poll"] == "Failed"
            assert outcome["kind"] == "INCOMPATIBLE"
            assert "only into GPU memory" in outcome["reason"]
        assert report["channel"]["sent"] == 0
        return
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 3
    assert set(report["prefill"].values()) == {"Success"}


@BACKENDS
def test_rooms_decode_aborts_end_on_both_sides_and_their_pages_come_free(backend: str) -> None:
    report = scenario(rooms=4, abort_rooms=[1, 2], backend=backend)
    for room in ("1", "2"):
        outcome = report["decode"][room]
        assert outcome["poll"] == "Failed"
        assert outcome["reason"] == "aborted by decode: the scheduler gave up on it"
        # sglang's prefill acknowledged the abort with its generation: nothing in flight.
        assert outcome["pages_safe"]
        assert report["prefill"][room] == "Failed"
    assert report["decode"]["0"]["poll"] == report["decode"]["3"]["poll"] == "Success"
    assert report["verified"] == 2


@BACKENDS
def test_a_killed_sglang_prefill_fails_its_rooms_within_the_peer_timeout(backend: str) -> None:
    report = scenario(rooms=3, kill_prefill=True, backend=backend)
    for outcome in report["decode"].values():
        assert outcome["poll"] == "Failed"
        assert outcome["kind"] == "PEER_DEAD"
        assert "SGLang prefill" in outcome["reason"]
        assert "silent for" in outcome["reason"]
        # peer_timeout_s (3 s) after its bootstrap's last health answer.
        assert outcome["failed_after_s"] < 3.0 + 2.0
        # It was told to abort (it may only be hung) and never acknowledged: its pages stay
        # out of use until sglang's own release time (ABORT_RELEASE_S) has passed.
        assert not outcome["pages_safe"]


# A hybrid model's Mamba state moves over Mooncake only here: sglang's NIXL backend registers
# state buffers as GPU memory on both sides (its manager cannot start on this machine with
# one), and kvbridge refuses a host-memory state toward it (tests/unit/test_decode_sglang.py).
@pytest.mark.parametrize("decode_tp", [1, 2])
def test_a_hybrid_models_mamba_state_comes_from_sglangs_prefill(decode_tp: int) -> None:
    # Between TP sizes sglang's prefill cuts each state slot by the units decode published:
    # each decode rank checks its share of every conv and SSM buffer, beside its KV and aux.
    report = scenario(rooms=3, mamba=True, decode_tp=decode_tp)
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 3
    assert set(report["prefill"].values()) == {"Success"}


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_aux_slots_sglangs_prefill_sends_over_zmq_land_in_the_slots_asked(decode_tp: int) -> None:
    # SGLANG_MOONCAKE_SEND_AUX_TCP: sglang's prefill sends each room's aux slot as an AUX_DATA
    # message to every decode rank it writes, before its status; each rank copies it into the
    # slot its room asked for (checked with the KV).
    report = scenario(rooms=4, aux_over_zmq=True, decode_tp=decode_tp)
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 4
    assert report["channel"]["received"] >= 8 * decode_tp  # an AUX_DATA and a status per room


@pytest.mark.parametrize(
    ("backend", "follow_bootstrap_room"),
    [("mooncake", True), ("mooncake", False), ("nixl", False)],
)
def test_a_kvbridge_decode_finds_the_dp_rank_of_sglangs_prefill_that_took_each_room(
    backend: str, follow_bootstrap_room: bool
) -> None:
    # sglang's prefill with DP attention: two schedulers, each an attention-DP rank of TP 1
    # taking its own rooms. Following bootstrap rooms, decode takes the room's number modulo
    # 2; with round robin the rank that took a room registers it and decode asks sglang's
    # bootstrap (`POST /query_dp_ranks`), before that rank may have opened it. Rooms go in
    # blocks there (0-2 to DP 0, 3-4 to DP 1): the modulo would ask the wrong rank.
    report = scenario(
        rooms=5, prefill_dp=2, follow_bootstrap_room=follow_bootstrap_room, backend=backend
    )
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 5
    assert report["prefill"] == {str(room): "Success" for room in range(5)}


def sglang_decode(**spec: Any) -> dict[str, Any]:
    return scenario("live_sglang_decode.py", **spec)


@BACKENDS
def test_sglangs_decode_receives_every_byte_from_a_kvbridge_prefill(backend: str) -> None:
    report = sglang_decode(rooms=6, pages_per_room=8, chunks=2, backend=backend)
    assert set(report["decode"].values()) == {"Success"}
    assert report["verified"] == 6
    assert {room["poll"] for room in report["prefill"].values()} == {"Success"}


@BACKENDS
def test_two_kvbridge_prefill_ranks_each_write_their_heads_into_one_sglang_decode_rank(
    backend: str,
) -> None:
    # sglang's decode (TP 1) asks both prefill ranks, per room, and waits for both statuses;
    # each writes its half of the heads token by token: every byte checked.
    report = sglang_decode(rooms=3, prefill_tp=2, backend=backend)
    assert set(report["decode"].values()) == {"Success"}
    assert report["verified"] == 3
    assert {room["poll"] for room in report["prefill"].values()} == {"Success"}


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_sglangs_decode_gets_a_hybrid_models_mamba_state_from_kvbridge(prefill_tp: int) -> None:
    # Two prefill ranks each write their units of every state slot into sglang's whole slot.
    report = sglang_decode(rooms=3, mamba=True, prefill_tp=prefill_tp)
    assert set(report["decode"].values()) == {"Success"}
    assert report["verified"] == 3
    assert {room["poll"] for room in report["prefill"].values()} == {"Success"}


@pytest.mark.parametrize(
    ("backend", "follow_bootstrap_room", "prefill_tp"),
    [("mooncake", True, 1), ("mooncake", False, 1), ("nixl", False, 2)],
)
def test_sglangs_decode_finds_the_kvbridge_prefill_dp_rank_that_took_each_room(
    backend: str, follow_bootstrap_room: bool, prefill_tp: int
) -> None:
    # kvbridge prefill ranks as an SGLang instance with two DP ranks (`DataParallel`), each
    # taking its own rooms. sglang's decode reads the instance from kvbridge's bootstrap and
    # resolves each room's DP rank as its scheduler does: modulo 2, or asking
    # (`query_prefill_dp_ranks`) where each rank registered its rooms — in blocks (0-2 to DP
    # 0, 3-4 to DP 1), so the modulo would ask the wrong rank.
    report = sglang_decode(
        rooms=5,
        prefill_dp=2,
        prefill_tp=prefill_tp,
        follow_bootstrap_room=follow_bootstrap_room,
        backend=backend,
    )
    assert set(report["decode"].values()) == {"Success"}
    assert report["verified"] == 5
    assert {room["poll"] for room in report["prefill"].values()} == {"Success"}


@BACKENDS
def test_mla_one_kvbridge_prefill_rank_writes_and_the_dummy_stays_silent(backend: str) -> None:
    # MLA, prefill TP 2 → decode TP 1: sglang's decode asks rank 0 for the latent and sends
    # rank 1 a dummy request, waiting for rank 0's status alone; rank 1 sends nothing.
    report = sglang_decode(rooms=4, prefill_tp=2, mla=True, backend=backend)
    assert set(report["decode"].values()) == {"Success"}
    assert report["verified"] == 4
    assert report["sent_by_rank"] == [4, 0]
    assert {room["poll"] for room in report["prefill"].values()} == {"Success"}


@BACKENDS
def test_sglangs_decode_aborts_rooms_and_counts_kvbridges_acks(backend: str) -> None:
    report = sglang_decode(rooms=4, abort_rooms=[1, 2], backend=backend)
    for room in ("1", "2"):
        assert report["decode"][room] == "Failed"
        assert report["prefill"][room]["poll"] == "Failed"
        assert (
            report["prefill"][room]["reason"] == f"room {room}: aborted by decode: no reason given"
        )
        # sglang's deferred release counted the ABORT_ACK: it echoed the abort's generation.
        assert report["abort_acked"][room] is True
    assert report["decode"]["0"] == report["decode"]["3"] == "Success"
    assert report["verified"] == 2


@BACKENDS
def test_a_killed_sglang_decode_fails_the_rooms_being_written_at_once(backend: str) -> None:
    report = sglang_decode(rooms=3, kill_decode=True, timeout_s=20, backend=backend)
    assert report["decode"] == "no report"
    for outcome in report["prefill"].values():
        assert outcome["poll"] == "Failed"
        assert "write failed" in outcome["reason"]
        gone = "the peer gone" if backend == "mooncake" else "NIXL_ERR_REMOTE_DISCONNECT"
        assert gone in outcome["reason"]
        assert outcome["failed_after_s"] < 5.0


def inspected(directory: Path) -> Counter[str]:
    """`kvbridge inspect --file` on every message kvbridge's side captured: each reads whole
    (exit 0); the message types it named, counted."""
    types: Counter[str] = Counter()
    files = sorted(directory.rglob("*.json"))
    assert files, "nothing captured"
    for path in files:
        shown = subprocess.run(
            [sys.executable, "-m", "kvbridge", "inspect", "--file", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, f"{path.name}: {shown.stdout}{shown.stderr}"
        title = next(line for line in shown.stdout.splitlines() if " · " in line)
        types[title.split(" · ")[1].strip().split()[0]] += 1
    return types


@BACKENDS
def test_inspect_reads_every_frame_of_a_live_session(backend: str, tmp_path: Path) -> None:
    """Both directions, with aborts: every control message kvbridge sent and received,
    captured (`KVBRIDGE_CAPTURE_DIR`) and read back by `kvbridge inspect`."""
    decode_side, prefill_side = tmp_path / "decode", tmp_path / "prefill"
    scenario(rooms=3, abort_rooms=[1], backend=backend, capture_dir=str(decode_side))
    sglang_decode(rooms=3, abort_rooms=[1], backend=backend, capture_dir=str(prefill_side))
    registration = "KVArgsRegisterInfo"
    status = "TransferStatus" if backend == "mooncake" else "KV_STATUS"
    # kvbridge's decode: its registration, one request per room and an abort went out; the
    # statuses and the abort's ack came back.
    decode_types = inspected(decode_side)
    assert decode_types[registration] == 1
    assert decode_types["TransferInfo"] == 3
    assert decode_types["ABORT"] == 1
    assert decode_types["ABORT_ACK"] == 1
    assert decode_types[status] >= 2
    # kvbridge's prefill: sglang's registration and requests came, statuses and the ack left.
    prefill_types = inspected(prefill_side)
    assert prefill_types[registration] == 1
    assert prefill_types["TransferInfo"] == 3
    assert prefill_types["ABORT"] == 1
    assert prefill_types["ABORT_ACK"] == 1
    assert prefill_types[status] >= 2
