"""sglang 0.5.23's own frame builders and parsers, driven without a serving engine.

Runs inside .venv-sglang (scripts/sglang-env.sh). Each builder takes the inputs sglang's code
takes (a kv_args-like namespace, a room, indices, ...) and returns the frames sglang's own
method puts on the socket, caught by a recording socket; each parser feeds frames to sglang's
own parsing code and returns what sglang made of them, as a plain dict (`None` where sglang
drops the message). Objects are made with ``__new__`` and given only the attributes the
method reads (../shared/reference/sglang-cpu.md); the frames equal a fully built manager's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
from sglang_import import import_sglang

MODULES = import_sglang()
mooncake_conn = MODULES["sglang.srt.disaggregation.mooncake.conn"]
nixl_conn = MODULES["sglang.srt.disaggregation.nixl.conn"]
common_conn = MODULES["sglang.srt.disaggregation.common.conn"]
from sglang.srt.disaggregation.common import staging_handler  # noqa: E402

logging.getLogger("sglang").setLevel(logging.CRITICAL)

LOCAL_IP = "10.0.0.7"
RANK_PORT = 17001
SESSION = "10.0.0.7:15001"


class RecordingSocket:
    """Stands in for a ZMQ PUSH socket: keeps every multipart message sent."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append([bytes(frame) for frame in frames])


def _recording_manager(cls: type) -> tuple[Any, RecordingSocket]:
    manager = cls.__new__(cls)
    socket = RecordingSocket()
    manager._send_multipart_locked = lambda endpoint, parts, is_ipv6=False: socket.send_multipart(
        parts
    )
    return manager, socket


def _unique_rank(manager: Any, prefill_rank: int) -> None:
    # _prefill_unique_rank() = attn_tp_rank * (pp_size * attn_cp_size) + ...; with pp and cp
    # of 1 it is the TP rank.
    manager.attn_tp_rank, manager.pp_size, manager.attn_cp_size = prefill_rank, 1, 1
    manager.pp_rank, manager.attn_cp_rank = 0, 0


def _registering_manager(cls: type, inputs: dict[str, Any]) -> Any:
    """A decode manager with what both backends' registration builders read."""
    manager = cls.__new__(cls)
    manager.kv_args = SimpleNamespace(**inputs["kv_args"])
    manager.attn_tp_size = inputs["attn_tp_size"]
    manager.local_ip, manager.rank_port = LOCAL_IP, RANK_PORT
    manager.dcp_size, manager.dcp_rank = inputs["dcp_size"], inputs["dcp_rank"]
    base, size = inputs["staging"] or (None, None)
    manager.enable_staging = base is not None
    allocator = (
        None
        if base is None
        else SimpleNamespace(get_base_ptr=lambda: base, get_total_size=lambda: size)
    )
    manager._staging_ctx = SimpleNamespace(allocator=allocator)
    return manager


# --- builders: inputs → the frames sglang sends ------------------------------------------------


def build_mooncake_registration(inputs: dict[str, Any]) -> list[bytes]:
    manager = _registering_manager(mooncake_conn.MooncakeKVManager, inputs)
    manager.get_session_id = lambda: inputs["session_id"]
    manager.kv_buffer_tensors = {"slot_layer_ids": inputs["slot_layer_ids"]}
    return manager.build_receiver_registration_message()


def build_nixl_registration(inputs: dict[str, Any]) -> list[bytes]:
    manager = _registering_manager(nixl_conn.NixlKVManager, inputs)
    metadata = bytes.fromhex(inputs["agent_metadata"])
    manager.agent = SimpleNamespace(name=inputs["agent_name"], get_agent_metadata=lambda: metadata)
    return manager.build_receiver_registration_message()


def _metadata(cls: type, inputs: dict[str, Any]) -> list[bytes]:
    manager = cls.__new__(cls)
    manager.local_ip, manager.rank_port = LOCAL_IP, RANK_PORT
    manager.get_session_id = lambda: SESSION
    manager.agent = SimpleNamespace(name=inputs.get("agent_name", ""))
    device = inputs.get("device_kv_indices")
    return manager.build_receiver_metadata_message(
        bootstrap_room=inputs["room"],
        required_dst_info_num=inputs["required_dst_info_num"],
        kv_indices=np.array(inputs["kv_indices"], dtype=np.int32),
        aux_index=inputs["aux_index"],
        state_indices=inputs["state_indices"],
        decode_prefix_len=inputs["decode_prefix_len"],
        is_dummy=inputs["is_dummy"],
        device_kv_indices=None if device is None else np.array(device, dtype=np.int32),
    )


def build_mooncake_transfer_info(inputs: dict[str, Any]) -> list[bytes]:
    return _metadata(mooncake_conn.MooncakeKVManager, inputs)


def build_nixl_transfer_info(inputs: dict[str, Any]) -> list[bytes]:
    return _metadata(nixl_conn.NixlKVManager, inputs)


def build_abort(inputs: dict[str, Any]) -> list[bytes]:
    return common_conn.AbortNotification(**inputs).to_zmq()


def build_abort_ack(inputs: dict[str, Any]) -> list[bytes]:
    return common_conn.AbortAck(**inputs).to_zmq()


def build_legacy_abort_ack(inputs: dict[str, Any]) -> list[bytes]:
    """What a Mooncake prefill without deferred release answers to an ABORT."""
    manager, socket = _recording_manager(mooncake_conn.MooncakeKVManager)
    manager.request_status = {}
    notification = common_conn.AbortNotification(inputs["room"], LOCAL_IP, RANK_PORT)
    manager._handle_legacy_abort_notification(notification, False)
    return _only(socket)


def _status(cls: type, inputs: dict[str, Any]) -> list[bytes]:
    manager = cls.__new__(cls)
    _unique_rank(manager, inputs["prefill_rank"])
    return manager._encode_kv_status_message(
        bootstrap_room=inputs["room"],
        status=inputs["status"],
        failure_reason=inputs["reason"],
    )


def build_mooncake_status(inputs: dict[str, Any]) -> list[bytes]:
    return _status(mooncake_conn.MooncakeKVManager, inputs)


def build_nixl_status(inputs: dict[str, Any]) -> list[bytes]:
    return _status(nixl_conn.NixlKVManager, inputs)


def build_chunk_ready(inputs: dict[str, Any]) -> list[bytes]:
    manager, socket = _recording_manager(mooncake_conn.MooncakeKVManager)
    _unique_rank(manager, inputs["prefill_rank"])
    manager.send_chunk_ready(
        room=inputs["room"],
        chunk_idx=inputs["chunk_idx"],
        page_start=inputs["page_start"],
        num_pages=inputs["num_pages"],
        writer_id=inputs["writer_id"],
        targets=[(LOCAL_IP, RANK_PORT)],
    )
    return _only(socket)


def build_aux_data(inputs: dict[str, Any]) -> list[bytes]:
    manager, socket = _recording_manager(mooncake_conn.MooncakeKVManager)
    manager.send_aux_data_to_endpoint(
        LOCAL_IP,
        RANK_PORT,
        inputs["room"],
        inputs["buffer_index"],
        inputs["aux_index"],
        bytes.fromhex(inputs["data"]),
    )
    return _only(socket)


def build_staging_req(inputs: dict[str, Any]) -> list[list[bytes]]:
    """Every STAGING_REQ `prefetch_staging_reqs` sends for one room (one per chunk)."""
    socket = RecordingSocket()
    info = SimpleNamespace(
        is_dummy=False,
        dst_kv_indices=np.arange(inputs["total_pages"], dtype=np.int32),
        endpoint=LOCAL_IP,
        dst_port=RANK_PORT,
    )
    staging_handler.prefetch_staging_reqs(
        inputs["room"],
        {inputs["room"]: {inputs["session_id"]: info}},
        {"page_size": inputs["page_size"]},
        inputs["chunked_prefill_size"],
        set(),
        {f"tcp://{LOCAL_IP}:{RANK_PORT}": socket},
        requester_pp_rank=inputs["pp_rank"],
    )
    return socket.sent


class _Receiver:
    """A decode receiver as the staging and watermark senders use it."""

    def __init__(self, pp_ranks: list[int]) -> None:
        self.socket = RecordingSocket()
        self.bootstrap_infos = [
            {"rank_ip": LOCAL_IP, "rank_port": RANK_PORT + i, "pp_rank": pp}
            for i, pp in enumerate(pp_ranks)
        ]
        self.chunk_staging_infos: list[Any] = []
        self.answered: list[int] = []

    def _connect_to_bootstrap_server(self, info: dict[str, Any]) -> tuple[Any, Any]:
        self.answered.append(info["pp_rank"])
        return self.socket, threading.Lock()


@contextlib.contextmanager
def _patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _staging_reply(
    message: list[bytes], grant: tuple[int, int] | None, pp_ranks: list[int]
) -> tuple[list[list[bytes]], dict[str, Any]]:
    """Feed a STAGING_REQ to sglang's handle_staging_req: the STAGING_RSP frames it sends and
    what it read (chunk tokens from the layout call, pp ranks answered)."""
    seen: dict[str, Any] = {}
    receiver = _Receiver(pp_ranks)

    def layout(src_tp: int, dst_tp: int, rank: int, heads: int, tokens: int, *rest: int) -> Any:
        seen["chunk_tokens"] = tokens
        return None, None, 4096

    def assign(required: int) -> tuple[int, int, int] | None:
        return None if grant is None else (1, grant[0], grant[1])

    allocator = SimpleNamespace(assign=assign, total_size=1 << 20)
    kv_args = SimpleNamespace(
        page_size=1, kv_item_lens=[128, 128], engine_rank=0, kv_head_num=1, gpu_id=0
    )
    room = int(message[1].decode("ascii"))
    from sglang.srt.disaggregation.common import staging_buffer

    with _patched(staging_buffer, "compute_staging_layout", layout):
        staging_handler.handle_staging_req(
            message,
            allocator,
            kv_args,
            1,
            1,
            None,
            {room: receiver},
            {room: receiver.bootstrap_infos},
        )
    seen["answered_pp_ranks"] = receiver.answered
    return receiver.socket.sent, seen


def build_staging_rsp(inputs: dict[str, Any]) -> list[bytes]:
    request = [
        b"STAGING_REQ",
        str(inputs["room"]).encode(),
        str(inputs["chunk_idx"]).encode(),
        b"4",
        inputs["session_id"].encode(),
    ]
    grant = None if inputs["never_fits"] else (inputs["offset"], inputs["round"])
    sent, _ = _staging_reply(request, grant, [0])
    assert len(sent) == 1, sent
    return sent[0]


def build_watermark(inputs: dict[str, Any]) -> list[bytes]:
    receiver = _Receiver([0])
    staging_handler.DecodeStagingHandler._send_watermark(
        receiver, inputs["session_id"], (inputs["round"], inputs["tail"])
    )
    return _only(receiver.socket)


BOOTSTRAP_SOURCE = """[
                            b"BOOTSTRAP",
                            str(self.bootstrap_room).encode("ascii"),
                            self.kv_mgr.local_ip.encode("ascii"),
                            str(self.kv_mgr.rank_port).encode("ascii"),
                        ]"""


def build_bootstrap(inputs: dict[str, Any]) -> list[bytes]:
    """BOOTSTRAP is built inline in CommonKVReceiver.init, which needs a whole prefill
    parallel-info table to run: its source is checked to be the four frames below."""
    assert BOOTSTRAP_SOURCE in inspect.getsource(common_conn.CommonKVReceiver.init)
    return [
        b"BOOTSTRAP",
        str(inputs["room"]).encode("ascii"),
        LOCAL_IP.encode("ascii"),
        str(inputs["decode_port"]).encode("ascii"),
    ]


def _only(socket: RecordingSocket) -> list[bytes]:
    assert len(socket.sent) == 1, socket.sent
    return socket.sent[0]


# --- parsers: frames → what sglang reads -------------------------------------------------------

_NOT_FROM_THE_WIRE = {
    "requires_dcp_relayout",
    "dcp_token_item_lens",
    "dcp_dst_region_indices",
    "dst_homogeneous_mem_kind",
    "kv_xfer_segments",
}


def plain(value: Any) -> Any:
    """A parse result as JSON-able data: arrays as lists, dataclasses as dicts."""
    if isinstance(value, np.ndarray):
        return [int(v) for v in value.tolist()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            item.name: plain(getattr(value, item.name))
            for item in dataclasses.fields(value)
            if item.name not in _NOT_FROM_THE_WIRE
        }
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (np.integer,)):
        return int(value)
    return value


def _guarded(frames: list[bytes]) -> list[bytes]:
    assert frames[0] == nixl_conn.GUARD, frames[0]
    return frames[1:]


def parse_mooncake_registration(frames: list[bytes]) -> Any:
    return plain(mooncake_conn.KVArgsRegisterInfo.from_zmq(frames))


def parse_mooncake_transfer_info(frames: list[bytes]) -> Any:
    return plain(mooncake_conn.TransferInfo.from_zmq(frames))


def parse_nixl_registration(frames: list[bytes]) -> Any:
    return plain(nixl_conn.KVArgsRegisterInfo.from_zmq(_guarded(frames)))


def parse_nixl_transfer_info(frames: list[bytes]) -> Any:
    return plain(nixl_conn.TransferInfo.from_zmq(_guarded(frames)))


def _struct(value: Any) -> Any:
    if value is None:
        return None
    return {name: getattr(value, name) for name in value.__struct_fields__}


def parse_abort(frames: list[bytes]) -> Any:
    return _struct(common_conn.AbortNotification.from_zmq(frames))


def parse_abort_ack(frames: list[bytes]) -> Any:
    return _struct(common_conn.AbortAck.from_zmq(frames))


def _parse_status(cls: type, frames: list[bytes]) -> Any:
    manager = cls.__new__(cls)
    parsed = manager.parse_kv_status_message(frames)
    if parsed is None:
        return None
    room, status, prefill_rank, reason = parsed
    return {"room": room, "status": status, "prefill_rank": prefill_rank, "reason": reason}


def parse_mooncake_status(frames: list[bytes]) -> Any:
    return _parse_status(mooncake_conn.MooncakeKVManager, frames)


def parse_nixl_status(frames: list[bytes]) -> Any:
    return _parse_status(nixl_conn.NixlKVManager, frames)


def parse_chunk_ready(frames: list[bytes]) -> Any:
    arrived: list[dict[str, Any]] = []
    manager = mooncake_conn.MooncakeKVManager.__new__(mooncake_conn.MooncakeKVManager)
    handler = SimpleNamespace(
        handle_chunk_arrived=lambda room, chunk, start, pages, writer: arrived.append(
            {
                "room": room,
                "chunk_idx": chunk,
                "page_start": start,
                "num_pages": pages,
                "writer_id": writer,
            }
        )
    )
    manager._staging_handler = handler
    manager.request_status = _Everything()
    assert manager.handle_chunk_ready(frames)
    return arrived[0] if arrived else None


class _Everything(dict):  # type: ignore[type-arg]
    """A room table that holds every room (handle_chunk_ready drops unknown rooms)."""

    def __contains__(self, key: object) -> bool:
        return True


def parse_aux_data(frames: list[bytes]) -> Any:
    stored: list[dict[str, Any]] = []

    class Codec:
        @staticmethod
        def deserialize_data_to_buffer(kv_args: Any, buffer: int, aux: int, data: bytes) -> None:
            stored.append({"buffer_index": buffer, "aux_index": aux, "data": data.hex()})

    manager = mooncake_conn.MooncakeKVManager.__new__(mooncake_conn.MooncakeKVManager)
    manager.kv_args = None
    with _patched(mooncake_conn, "AuxDataCodec", Codec):
        manager._handle_aux_data(frames)
    return stored[0] if stored else None


def parse_staging_req(frames: list[bytes]) -> Any:
    sent, seen = _staging_reply(frames, (0, 0), [0, 1, 2, 3])
    if not sent:
        return None
    reply = sent[0]
    return {
        "room": int(reply[1]),
        "chunk_idx": int(reply[2]),
        "chunk_num_pages": seen["chunk_tokens"],  # page_size 1
        "session_id": reply[6].decode("ascii"),
        "answered_pp_ranks": seen["answered_pp_ranks"],
    }


def parse_staging_rsp(frames: list[bytes], room: int, session_id: str) -> Any:
    info = SimpleNamespace(staging=None)
    staging_handler.handle_staging_rsp(frames, {room: {session_id: info}})
    if info.staging is None:
        return None  # not this room and session
    chunk = len(info.staging.offsets) - 1  # set_chunk grows the lists up to the chunk
    return {
        "room": room,
        "chunk_idx": chunk,
        "offset": info.staging.offsets[chunk],
        "round": info.staging.rounds[chunk],
        "end": info.staging.ends[chunk],
        "session_id": session_id,
    }


def parse_watermark(frames: list[bytes]) -> Any:
    context = SimpleNamespace(remote_watermarks={}, watermark_cv=threading.Condition())
    staging_handler.handle_watermark_msg(context, frames)
    return {session: list(mark) for session, mark in context.remote_watermarks.items()}


def parse_bootstrap(frames: list[bytes]) -> Any:
    registered: list[dict[str, Any]] = []
    manager = mooncake_conn.MooncakeKVManager.__new__(mooncake_conn.MooncakeKVManager)
    manager.deferred_bootstrap = SimpleNamespace(
        register=lambda room, endpoint: registered.append(
            {"room": room, "endpoint": list(endpoint)}
        )
    )
    manager._notify_bootstrap = lambda room, notification: None
    assert manager._handle_bootstrap_message(frames)
    return registered[0] if registered else None


BUILDERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "mooncake-registration": build_mooncake_registration,
    "mooncake-transfer-info": build_mooncake_transfer_info,
    "mooncake-status": build_mooncake_status,
    "nixl-registration": build_nixl_registration,
    "nixl-transfer-info": build_nixl_transfer_info,
    "nixl-status": build_nixl_status,
    "abort": build_abort,
    "abort-ack": build_abort_ack,
    "legacy-abort-ack": build_legacy_abort_ack,
    "chunk-ready": build_chunk_ready,
    "aux-data": build_aux_data,
    "staging-req": build_staging_req,
    "staging-rsp": build_staging_rsp,
    "watermark": build_watermark,
    "bootstrap": build_bootstrap,
}


# Each parser with one signature; `hint` is what a listener already knows (the room and
# session a STAGING_RSP is looked up under).
PARSERS: dict[str, Callable[[list[bytes], dict[str, Any]], Any]] = {
    "mooncake-registration": lambda frames, hint: parse_mooncake_registration(frames),
    "mooncake-transfer-info": lambda frames, hint: parse_mooncake_transfer_info(frames),
    "mooncake-status": lambda frames, hint: parse_mooncake_status(frames),
    "nixl-registration": lambda frames, hint: parse_nixl_registration(frames),
    "nixl-transfer-info": lambda frames, hint: parse_nixl_transfer_info(frames),
    "nixl-status": lambda frames, hint: parse_nixl_status(frames),
    "abort": lambda frames, hint: parse_abort(frames),
    "abort-ack": lambda frames, hint: parse_abort_ack(frames),
    "legacy-abort-ack": lambda frames, hint: parse_abort_ack(frames),
    "chunk-ready": lambda frames, hint: parse_chunk_ready(frames),
    "aux-data": lambda frames, hint: parse_aux_data(frames),
    "staging-req": lambda frames, hint: parse_staging_req(frames),
    "staging-rsp": lambda frames, hint: parse_staging_rsp(frames, hint["room"], hint["session_id"]),
    "watermark": lambda frames, hint: parse_watermark(frames),
    "bootstrap": lambda frames, hint: parse_bootstrap(frames),
}


def build(kind: str, inputs: dict[str, Any]) -> list[list[bytes]]:
    """Every message sglang's builder of this kind sends for these inputs."""
    built = BUILDERS[kind](inputs)
    return built if kind == "staging-req" else [built]
