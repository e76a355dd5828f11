"""Hypothesis strategies for every message of every profile, derived from the layouts.

Values come from each field's codec; a small per-message repair step then makes the message
obey its cross-field rules (staging, DCP, dummy requests, buffer counts) so that no example is
thrown away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvbridge.wire import PROFILES, KVLayout, Layout, Message, Profile
from kvbridge.wire import codecs as c
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.messages import MAX_PORT, Abort
from kvbridge.wire.native import Registration, TransferRequest
from kvbridge.wire.sglang import common, mooncake, nixl

MAX_ITEMS = 12
HOSTS = st.ip_addresses().map(str) | st.from_regex(
    r"[a-z][a-z0-9-]{0,20}[a-z0-9](\.[a-z]{2,8}){0,3}", fullmatch=True
)


def codec_values(codec: c.Codec[Any]) -> st.SearchStrategy[Any]:
    """Every value a codec can carry."""
    if isinstance(codec, c.AsciiText):
        return st.text(alphabet=st.characters(codec="ascii"), max_size=40)
    if isinstance(codec, c.HostText):
        return HOSTS
    if isinstance(codec, c.EndpointText):
        return st.builds(tcp_endpoint, HOSTS, st.integers(1, MAX_PORT))
    if isinstance(codec, c.Utf8Text):
        return st.text(max_size=40)
    if isinstance(codec, c.OpaqueBytes):
        return st.binary(max_size=64)
    if isinstance(codec, (c.AsciiInt, c.FixedInt)):
        return st.integers(codec.low, codec.high)
    if isinstance(codec, (c.Bool, c.AsciiBool)):
        return st.booleans()
    if isinstance(codec, c.AsciiNames):
        return st.lists(st.sampled_from(sorted(codec.allowed)), max_size=MAX_ITEMS)
    if isinstance(codec, (c.EnumU8, c.AsciiEnum)):
        return st.sampled_from(list(codec.enum_type))
    if isinstance(codec, c.PackedInts):
        return st.lists(st.integers(codec.low, codec.high), max_size=MAX_ITEMS)
    if isinstance(codec, c.Int32Array):
        return st.lists(st.integers(-(2**31), 2**31 - 1), max_size=MAX_ITEMS).map(
            lambda values: np.array(values, dtype=np.int32)
        )
    if isinstance(codec, c.NestedIntLists):
        return st.lists(codec_values(codec.inner), max_size=5)
    if isinstance(codec, c.StringSet):
        name = st.text(
            alphabet=st.characters(exclude_characters=",", exclude_categories=("Cs",)),
            min_size=1,
            max_size=12,
        )
        return st.frozensets(name, max_size=5)
    raise TypeError(f"no strategy for {codec!r}")


def _field_values(layout: Layout[Any], name: str) -> st.SearchStrategy[Any]:
    item = next(item for item in layout.fields if item.name == name)
    values = codec_values(item.codec)
    if item.default is None and not item.required:
        return st.none() | values
    return values


def _repair_staging(message: Any) -> None:
    if message.staging_base_ptr and not message.staging_total_size:
        message.staging_total_size = 1


def _repair_registration(message: Registration) -> None:
    _repair_staging(message)
    message.control_port %= MAX_PORT + 1
    for name in ("attn_tp_size", "total_kv_heads", "head_dim", "page_size", "dcp_size"):
        setattr(message, name, max(1, getattr(message, name)))
    message.tp_rank %= message.attn_tp_size
    message.dcp_rank %= message.dcp_size
    per_layer = 2 if message.kv_layout == KVLayout.MHA else 1
    layers = len(message.kv_ptrs) // per_layer
    message.kv_ptrs = message.kv_ptrs[: layers * per_layer]
    message.kv_layer_ids = list(range(layers))
    # Regions must lie inside the address space (bit 63 stays possible, wrapping does not).
    message.kv_ptrs = [max(1, ptr % 2**64 - 2**20) for ptr in message.kv_ptrs]
    message.aux_ptrs = [max(1, ptr - 2**20) for ptr in message.aux_ptrs]
    message.state_ptrs = [[max(1, ptr - 2**20) for ptr in group] for group in message.state_ptrs]
    if message.staging_base_ptr:
        message.staging_base_ptr = max(1, message.staging_base_ptr - 2**40)
        message.staging_total_size = message.staging_total_size % 2**40 or 1
    message.kv_item_lens = [4096] * len(message.kv_ptrs)
    message.kv_lengths = [4096 * 8] * len(message.kv_ptrs)
    message.aux_item_lens = [64] * len(message.aux_ptrs)
    message.aux_lengths = [64 * 16] * len(message.aux_ptrs)
    message.state_item_lens = [[8] * len(group) for group in message.state_ptrs]
    message.state_lengths = [[8 * 4] * len(group) for group in message.state_ptrs]
    message.state_parts = [parts[: len(parts) // 4 * 4] for parts in message.state_parts]


def _repair_sglang_registration(message: Any) -> None:
    _repair_staging(message)
    message.room = "None"  # how sglang tells a registration apart
    message.dst_port %= MAX_PORT + 1
    message.dst_dcp_size = max(1, message.dst_dcp_size)
    message.dst_dcp_rank %= message.dst_dcp_size
    if isinstance(message, nixl.KVArgsRegisterInfo):
        count = len(message.dst_kv_ptrs)
        message.dst_kv_mem_kinds = (message.dst_kv_mem_kinds * count or ["VRAM"] * count)[:count]
        message.dst_kv_item_lens = (message.dst_kv_item_lens * count or [1] * count)[:count]


def _repair_transfer_info(message: Any) -> None:
    message.dst_port %= MAX_PORT + 1
    if isinstance(message, mooncake.TransferInfo) and message.dst_aux_index is None:
        message.dst_kv_indices = np.array([], dtype=np.int32)
        message.dst_state_indices = []


def _repair_abort_notification(message: common.AbortNotification) -> None:
    if message.decode_port is not None:
        message.decode_port %= MAX_PORT + 1
        message.decode_ip = message.decode_ip or "10.0.0.1"
    elif message.generation is not None:
        message.generation = None


def _repair_abort_ack(message: common.AbortAck) -> None:
    if message.prefill_rank is None:
        message.generation = None


def _repair_aux_data(message: common.AuxData) -> None:
    message.data_length = len(message.data)


def _repair_bootstrap(message: common.Bootstrap) -> None:
    message.decode_port %= MAX_PORT + 1


def _repair_transfer_request(message: TransferRequest) -> None:
    if message.is_dummy:
        message.dst_kv_indices = np.array([], dtype=np.int32)
        message.dst_aux_index = None


def _repair_abort(message: Abort) -> None:
    message.decode_port %= MAX_PORT + 1


REPAIRS: dict[type[Message], Callable[[Any], None]] = {
    Registration: _repair_registration,
    mooncake.KVArgsRegisterInfo: _repair_sglang_registration,
    nixl.KVArgsRegisterInfo: _repair_sglang_registration,
    mooncake.TransferInfo: _repair_transfer_info,
    nixl.TransferInfo: _repair_transfer_info,
    TransferRequest: _repair_transfer_request,
    Abort: _repair_abort,
    common.AbortNotification: _repair_abort_notification,
    common.AbortAck: _repair_abort_ack,
    common.AuxData: _repair_aux_data,
    common.Bootstrap: _repair_bootstrap,
}


@st.composite
def messages_of(draw: st.DrawFn, layout: Layout[Any]) -> Message:
    """A valid message that this layout can carry."""
    values = {
        item.name: draw(_field_values(layout, item.name))
        for item in layout.fields
        if not item.is_constant
    }
    message = layout.message_type(**values)
    repair = REPAIRS.get(layout.message_type)
    if repair is not None:
        repair(message)
    return message


def all_layouts() -> list[tuple[Profile, Layout[Any]]]:
    return [(profile, layout) for profile in PROFILES.values() for layout in profile.layouts]


def layout_id(pair: tuple[Profile, Layout[Any]]) -> str:
    return f"{pair[0].name}:{pair[1].type_name}"


def draw_once(strategy: st.SearchStrategy[Any]) -> Any:
    """One deterministic draw, for tests that build a corpus and then run outside hypothesis
    (real processes and sockets should not be re-run by shrinking)."""
    drawn: list[Any] = []

    @settings(max_examples=1, derandomize=True, database=None, phases=[Phase.generate])
    @given(strategy)
    def draw(value: Any) -> None:
        drawn.append(value)

    draw()
    return drawn[0]


def corpus(per_layout: int) -> list[tuple[str, Message]]:
    """(profile, message) pairs: `per_layout` messages of every layout of every profile."""
    return draw_once(
        st.tuples(
            *[
                st.lists(messages_of(layout), min_size=per_layout, max_size=per_layout).map(
                    lambda messages, name=profile.name: [(name, m) for m in messages]
                )
                for profile, layout in all_layouts()
            ]
        ).map(lambda groups: [pair for group in groups for pair in group])
    )
