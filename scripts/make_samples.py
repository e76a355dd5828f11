import struct
import numpy as np
from kvbridge.wire import NATIVE, KVLayout, MemoryKind, Registration, TransferRequest
from kvbridge.wire.framefile import dump_json
from kvbridge.wire.sglang import mooncake, nixl
from kvbridge.samples import sample_folder

def Q(v): return struct.pack("Q", v)
out = sample_folder()
# The SGLang unit test's registration message, from shared/reference/sglang-wire.md.
ref = [b"room", b"127.0.0.1", b"1234", b"session", Q(0x1000), Q(0x2000), b"", b"0", b"1", b"128",
       b"", b"", b"", b"", Q(0x3000), b"4096", b"4", b"2"]
(out/"sglang-mooncake-registration.json").write_text(dump_json(ref, profile="sglang-mooncake",
    description="SGLang's unit-test registration: staging ring 0x3000/4096 bytes, DCP 4, rank 2"))
ti = mooncake.TransferInfo(room=42, endpoint="10.0.0.7", dst_port=17001, mooncake_session_id="10.0.0.7:15001",
    dst_kv_indices=np.arange(100, 164, dtype=np.int32), dst_aux_index=3, dst_state_indices=[],
    required_dst_info_num=2, decode_prefix_len=0)
(out/"sglang-mooncake-transfer-info.json").write_text(dump_json(ti.to_zmq(), profile="sglang-mooncake",
    description="Mooncake TransferInfo for room 42: 64 destination pages, aux slot 3"))
dummy = mooncake.TransferInfo(room=42, endpoint="10.0.0.7", dst_port=17001, mooncake_session_id="10.0.0.7:15001",
    dst_kv_indices=np.array([], dtype=np.int32), dst_aux_index=None, dst_state_indices=[], required_dst_info_num=2)
(out/"sglang-mooncake-dummy-transfer-info.json").write_text(dump_json(dummy.to_zmq(), profile="sglang-mooncake",
    description="Mooncake dummy TransferInfo (frames 4 and 5 empty): this prefill rank only reports completion"))
reg = nixl.KVArgsRegisterInfo(room="None", endpoint="10.0.0.7", dst_port=17001, agent_name="decode-0",
    agent_metadata=b"\x00NIXL-agent-metadata\xff", dst_kv_ptrs=[0xFFFF81AB54E01000 + i * 0x100000 for i in range(4)],
    dst_aux_ptrs=[0x7F0000000000], dst_state_data_ptrs=[], gpu_id=0, decode_tp_size=4, decode_tp_rank=1,
    dst_kv_item_len=4096, staging_base_ptr=0x7F1000000000, staging_total_size=64 << 20)
(out/"sglang-nixl-registration.json").write_text(dump_json(nixl.add_guard(reg.to_zmq()), profile="sglang-nixl",
    description="NIXL registration with its guard frame; pointers with bit 63 set; a 64 MiB staging ring"))
layers = 32
native_reg = Registration(peer_id="decode-0/tp1", host="10.0.0.7", control_port=17001, engine="nixl",
    engine_descriptor=b"\x00agent-metadata", tp_rank=1, attn_tp_size=2, dcp_rank=0, dcp_size=1,
    kv_layout=KVLayout.MHA, total_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16,
    kv_layer_ids=list(range(layers)), kv_ptrs=[0x7F0000000000 + i * (1 << 30) for i in range(2 * layers)],
    kv_item_lens=[16 * 4 * 128 * 2] * (2 * layers), kv_lengths=[16 * 4 * 128 * 2 * 4096] * (2 * layers),
    aux_ptrs=[0x7E0000000000], aux_item_lens=[64], aux_lengths=[64 * 4096],
    staging_base_ptr=0x7D0000000000, staging_total_size=256 << 20, capabilities=frozenset({"staging", "dcp"}))
(out/"native-registration.json").write_text(dump_json(NATIVE.encode(native_reg), profile="kvbridge/1",
    description="kvbridge/1 registration of a Llama-3-8B-like decode rank (TP 2, 32 layers, page size 16)"))
req = TransferRequest(room=42, peer_id="decode-0/tp1", is_dummy=False, dst_kv_indices=np.arange(0, 512, 2, dtype=np.int32),
    dst_aux_index=7, dst_state_indices=[], required_dst_info_num=1, decode_prefix_len=0)
(out/"native-transfer-request.json").write_text(dump_json(NATIVE.encode(req), profile="kvbridge/1",
    description="kvbridge/1 transfer request for room 42: 256 pages, aux slot 7, decode prefix 0 (present, not absent)"))
