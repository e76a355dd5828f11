"""sglang 0.5.23's real PD transfer layer (Mooncake), driven as its schedulers drive it but
without a model: the live peer of kvbridge's tests and of benchmarks/sglang_mooncake.py.

Runs inside .venv-sglang, in a network namespace of its own (Mooncake binds wildcard
listeners). `sglang_role` publishes a scheduler's server args and starts Mooncake's engine as
`prefill.py::_init_kv_manager` / `decode.py` do; `sglang_kv_args` fills sglang's `KVArgs` for
numpy buffers as `_init_kv_manager` fills it (../shared/reference/sglang-cpu.md).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# Environment as sglang is run on these machines: its host IP, Mooncake over TCP, and
# Mooncake's per-peer queue limits raised as sglang deployments raise them.
ENVIRONMENT = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "MC_LOG_LEVEL": "WARNING",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    # UCX's RDMA modules on a host without a card (kvbridge leaves them out in its own
    # processes; sglang's NIXL agent does not).
    "UCX_MODULES": "^ib,ib_efa,ib_mlx5,ib_mlx5_ext,ib_mlx5_gda,ib_mlx5_gdp",
}
BACKENDS = ("mooncake", "nixl")  # sglang's transfer backends, kvbridge's engines of the same names
AUX_BYTES = 64
SENTINEL = 0xA5A5  # what a live test's destination pages hold before any write
POLL_S = 0.002  # how often a live test polls its rooms


@dataclass(frozen=True)
class Geometry:
    """A rank's KV cache: `layers` K buffers then V buffers of `[pages, page, heads, dim]` bf16
    (as uint16), and `slots` aux slots of AUX_BYTES."""

    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    page: int = 16

    def buffers(
        self, pages: int, slots: int
    ) -> tuple[list[npt.NDArray[np.uint16]], npt.NDArray[np.uint8]]:
        """Zeroed and resident (written once, as sglang's torch.zeros pools are: a page first
        touched inside a transfer costs the kernel's fault and zeroing)."""
        shape = (pages, self.page, self.heads, self.head_dim)
        kv = [np.empty(shape, np.uint16) for _ in range(2 * self.layers)]
        aux = np.empty((slots, AUX_BYTES), np.uint8)
        for array in (*kv, aux):
            array.fill(0)
        return kv, aux

    @property
    def page_bytes(self) -> int:
        """One page of one KV buffer."""
        return self.page * self.heads * self.head_dim * 2

    def content(self, room: int, buffer: int, pages: int) -> npt.NDArray[np.uint16]:
        """A room's pages in one buffer: a function of (room, buffer, position)."""
        words = pages * self.page * self.heads * self.head_dim
        base = np.uint64((room * 1_000_003 + buffer) * 0x100000001B3 % 2**64)
        values = (np.arange(words // 4, dtype=np.uint64) + base) * np.uint64(0x9E3779B97F4A7C15)
        return values.view(np.uint16).reshape(pages, self.page, self.heads, self.head_dim)


def aux_content(room: int) -> int:
    return room % 251 + 1


@dataclass(frozen=True)
class MambaState:
    """A hybrid model's per-request state as sglang's `MambaPool` lays it out, per layer a
    conv state `[slots, channels, kernel - 1]` and an SSM state `[slots, heads, head_dim *
    state]` (uint16), each sharded by attention TP on its first per-slot axis, flattened
    tensor-major (every layer's conv state, then every SSM state) as
    `get_contiguous_buf_infos` flattens them."""

    layers: int = 2
    channels: int = 64
    kernel: int = 4
    heads: int = 8
    head_state: int = 16 * 16

    def rows(self) -> list[tuple[int, int]]:
        """(units model-wide, words per unit) of each buffer."""
        conv = (self.channels, self.kernel - 1)
        ssm = (self.heads, self.head_state)
        return [conv] * self.layers + [ssm] * self.layers

    def buffers(self, slots: int, tp: int) -> list[npt.NDArray[np.uint16]]:
        arrays = [np.empty((slots, units // tp, words), np.uint16) for units, words in self.rows()]
        for array in arrays:
            array.fill(SENTINEL)
        return arrays

    def dims(self, tp: int) -> list[int]:
        """Each buffer's units on one rank (sglang's `state_dim_per_tensor`)."""
        return [units // tp for units, _ in self.rows()]

    def content(self, room: int, buffer: int) -> npt.NDArray[np.uint16]:
        """A room's whole slot of one buffer, all ranks' units."""
        units, words = self.rows()[buffer]
        seed = np.uint32((room * 7919 + buffer * 104_729 + 17) % 2**32)
        values = np.arange(units * words, dtype=np.uint32) * np.uint32(2_654_435_761) + seed
        return (values >> np.uint32(8)).astype(np.uint16).reshape(units, words)

    def shard(self, room: int, buffer: int, rank: int, tp: int) -> npt.NDArray[np.uint16]:
        """What attention-TP rank `rank` of `tp` holds of the room's slot."""
        whole = self.content(room, buffer)
        share = whole.shape[0] // tp
        return whole[rank * share : (rank + 1) * share]


@dataclass(frozen=True)
class LiveRooms:
    """What every live scenario has: its rooms, each of `pages_per_room` pages sent in
    `chunks` chunks, a model of `layers` layers, and how long it may take."""

    rooms: int = 4
    pages_per_room: int = 8
    layers: int = 4
    chunks: int = 2  # prefill sends each room in this many chunks
    timeout_s: float = 60.0
    backend: str = "mooncake"  # sglang's transfer backend, and kvbridge's engine
    capture_dir: str = ""  # kvbridge's side writes every control message here (inspect's files)
    mamba: bool = False  # a hybrid model: every room also moves its Mamba state slot
    # The prefill side as an instance of this many DP ranks, each taking its own rooms:
    # following bootstrap rooms a room goes to its number modulo the DP size; otherwise (a
    # router's round robin) to the rank the test picks — in blocks, not by modulo — which
    # registers it at the bootstrap for decode to ask.
    prefill_dp: int = 1
    follow_bootstrap_room: bool = True

    def dp_rank_of(self, room: int) -> int:
        if self.follow_bootstrap_room:
            return room % self.prefill_dp
        return room * self.prefill_dp // self.rooms

    @property
    def state(self) -> MambaState | None:
        return MambaState() if self.mamba else None

    @property
    def geometry(self) -> Geometry:
        return Geometry(layers=self.layers)


def channel_counters(managers: list[Any]) -> dict[str, float]:
    """The kvbridge managers' channel counters, summed."""
    counters: dict[str, float] = {}
    for manager in managers:
        for name, value in vars(manager.channel.stats).items():
            counters[name] = counters.get(name, 0) + value
    return counters


def sglang_role(
    role: str,
    bootstrap_port: int,
    backend: str = "mooncake",
    world_rank: int = 0,
    **parallel: Any,
) -> dict[str, Any]:
    """Import sglang's PD modules and publish a scheduler's server args for `role` over
    `backend` (`parallel`: more server args, e.g. DP attention, for the scheduler at
    `world_rank`); the classes by kind (`KVARGS`, `MANAGER`, `SENDER`, `RECEIVER`,
    `BOOTSTRAP_SERVER`)."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_import import import_sglang

    import_sglang()
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=role,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=bootstrap_port,
        **parallel,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)
    if backend == "mooncake":  # sglang's NIXL manager makes its agent itself
        init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device=None)
    transfer = TransferBackend.NIXL if backend == "nixl" else TransferBackend.MOONCAKE

    def kind(name: str) -> Any:
        return get_kv_class(transfer, getattr(KVClassType, name))

    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return {"server_args": server_args, "mode": mode, "class": kind}


def sglang_kv_args(
    kind: Any,
    geometry: Geometry,
    kv: list[npt.NDArray[np.uint16]],
    aux: npt.NDArray[np.uint8],
    state: list[npt.NDArray[np.uint16]] | None = None,
) -> Any:
    """sglang's KVArgs for these buffers, filled as `_init_kv_manager` fills it (one rank);
    `state`: a `MambaState`'s buffers, as `setup_state_kv_args` appends a hybrid pool's."""
    args = kind("KVARGS")()
    pages = kv[0].shape[0]
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = 0, 0, 0, None
    args.kv_cache_dtype_str, args.kv_layout = "auto", None  # sglang's default: the model's
    args.prefill_start_layer, args.prefill_end_layer = 0, geometry.layers
    args.kv_data_ptrs = [b.ctypes.data for b in kv]
    # Host memory: sglang's decode sets this for NIXL (decode.py); its prefill never does,
    # and NIXL would then take the buffers for GPU memory.
    args.kv_data_mem_kinds = ["DRAM"] * len(kv)
    args.kv_data_lens = [b.nbytes for b in kv]
    args.kv_item_lens = [b.nbytes // pages for b in kv]
    args.num_draft_entries, args.kv_layer_ids = 0, []
    args.kv_head_num, args.total_kv_head_num, args.page_size = (
        geometry.heads,
        geometry.heads,
        geometry.page,
    )
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = (
        [aux.ctypes.data],
        [aux.nbytes],
        [AUX_BYTES],
    )
    args.ib_device, args.gpu_id = None, 0
    # setup_state_kv_args for a pool with no state (Llama): every state list empty.
    for name in (
        "state_types",
        "state_data_ptrs",
        "state_data_lens",
        "state_item_lens",
        "state_dim_per_tensor",
        "state_slice_outer_counts",
        "state_layer_ids",
        "state_conv_shard_groups",
    ):
        setattr(args, name, [])
    if state:
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import append_state_component

        append_state_component(
            args,
            StateType.MAMBA,
            [b.ctypes.data for b in state],
            [b.nbytes for b in state],
            [b.nbytes // b.shape[0] for b in state],
            [b.shape[1] for b in state],
            [None] * len(state),  # no GDN q/k/v sub-blocks
            [1] * len(state),
            [],  # no layer ids: one pipeline stage pairs buffers by position
        )
    args.is_hybrid_mla_backend, args.swa_kv_cache_layout, args.mla_compression_ratios = (
        False,
        None,
        None,
    )
    return args
