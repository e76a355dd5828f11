"""What a vLLM instance's KV cache groups take part in, and decode's plan of one request's
load from them (`plan_load`, decode first's `decode_first_remote`). Pure: reads vLLM's
request objects, imports nothing from vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.integrations.vllm_blocks import (
    Group,
    GroupKind,
    LoadPlanError,
    blocks_to_load,
    decode_first_layout,
)
from kvbridge.integrations.vllm_requests import RemotePrefill
from kvbridge.integrations.vllm_steps import LoadSpec


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler side knows of its instance: its role, its KV cache groups (those
    that take part in transfers) and its engine id."""

    engine_id: str
    produces: bool
    groups: tuple[Group, ...]
    pipeline_stages: int = 1
    # Prefill's lease on a finished request's blocks (its request_timeout_s), named in the
    # request's parameters for decode to renew.
    lease_s: float = 0.0

    @property
    def stream_group(self) -> int | None:
        """Decode first: the KV cache group whose layers go out during the forward, block
        by block as it fills them — the first full-attention group, with one pipeline stage.
        The other groups (sliding windows, whose blocks in the window are known only once the
        prompt is computed, recurrent states, further full-attention groups) go after the
        final forward, as the room's last chunks. None: nothing streams (no full attention,
        or pipeline stages: the whole request is written after the forward)."""
        return stream_group(self.groups, self.pipeline_stages)

    @property
    def streams(self) -> bool:
        """Whether a request's KV can go layer by layer, decode first (`stream_group`)."""
        return self.stream_group is not None

    @property
    def backoff(self) -> int:
        """Prompt tokens prefill leaves for decode to compute: with a recurrent state, decode
        must compute the last token on the state after the others, not on a state that
        already holds it."""
        return 1 if any(group.kind == GroupKind.STATE for group in self.groups) else 0


def stream_group(groups: Sequence[Group], pipeline_stages: int) -> int | None:
    """`SchedulerConfig.stream_group`, for the workers too."""
    full = (i for i, group in enumerate(groups) if group.kind == GroupKind.FULL)
    group = next(full, None)
    return group if pipeline_stages == 1 else None


def decode_first_remote(
    config: SchedulerConfig, remote: RemotePrefill, num_prompt_tokens: int
) -> RemotePrefill:
    """A decode-first load's remote as if prefill had answered: the prompt (less the
    `backoff`), each group's blocks from position 0 (`decode_first_layout`), in this
    instance's block sizes. One full-attention group's may differ on prefill (tokens map);
    several groups need one size on both sides, which only prefill can check here: it sends
    their pages positional (`KVSender.send`), and a decode rank of another page size fails
    the room as incompatible."""
    groups = config.groups
    tokens = num_prompt_tokens - config.backoff
    return replace(
        remote,
        num_tokens=tokens,
        blocks=decode_first_layout(groups, tokens),
        block_sizes=tuple(group.block_size for group in groups),
    )


def unloaded_blocks(
    groups: Sequence[Group], block_ids: Sequence[Sequence[int]], prefix: int
) -> tuple[tuple[int, ...], ...]:
    """The blocks a failed load leaves unfilled: past the local prefix (those stay valid,
    and other requests may share them)."""
    return tuple(
        tuple(
            b for b in ids[prefix // group.block_size if group.kind == GroupKind.FULL else 0 :] if b
        )
        for group, ids in zip(groups, block_ids, strict=False)
    )


def plan_load(
    config: SchedulerConfig,
    request: Any,
    remote: RemotePrefill,
    block_ids: Sequence[Sequence[int]],
    prefix: int,
    count: int,
) -> LoadSpec:
    """Decode: the request's load of `count` tokens after its local `prefix` into its
    blocks (`block_ids`, per group) from what `remote` holds; LoadPlanError for one that
    cannot be right."""
    groups = config.groups
    backoff = config.backoff
    if backoff and remote.num_tokens != request.num_prompt_tokens - backoff:
        raise LoadPlanError(
            f"prefill computed {remote.num_tokens} of {request.num_prompt_tokens} prompt "
            f"tokens; with a recurrent state it must stop {backoff} short (the state would "
            "take a token twice)"
        )
    if len(remote.blocks) != len(groups):
        raise LoadPlanError(
            f"prefill sends {len(remote.blocks)} KV cache group(s), this instance has "
            f"{len(groups)}: both must run the same model"
        )
    theirs = tuple(remote.block_sizes)
    ours = tuple(group.block_size for group in groups)
    one_full = len(groups) == 1 and groups[0].kind == GroupKind.FULL
    if theirs != ours and not one_full:
        raise LoadPlanError(
            f"block sizes differ: prefill {list(theirs)}, decode {list(ours)}; a model "
            "with several KV cache groups needs the same block size on both instances"
        )
    loads = blocks_to_load(
        groups, block_ids, prefix, count, remote.blocks, same_block_size=theirs == ours
    )
    return LoadSpec(
        request.request_id,
        remote,
        tuple(load.blocks for load in loads),
        tuple(load.skip for load in loads),
    )
