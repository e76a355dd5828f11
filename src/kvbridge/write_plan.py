"""The blocks of one write job (a `Write` that prefill's protocol handed out): planned over
both sides' caches, or from this rank's staging buffer once the job's chunk was gathered
there, plus the aux and state slots with a room's last chunk. The manager's worker runs it."""

from __future__ import annotations

import numpy as np

from kvbridge.cache import KVArgs, PlanError, TransferPlan, plan_slots
from kvbridge.cache.plan import FRESH, PlanArena, PlanMemory, plan_gathered, plan_state_slices
from kvbridge.core.prefill_events import PageRows, RingSpace, Write


def plan_write(
    local: KVArgs, write: Write, staging_ptr: int, memory: PlanMemory = FRESH
) -> TransferPlan:
    """A job's blocks: its KV (from the staging buffer when gathered: one block into decode's
    ring, or runs of decode's token rows; else planned over the caches, of the job's layers)
    plus, with the last chunk, the aux and state slots. `staging_ptr`: this rank's staging
    buffer."""
    job, peer_args, staged = write.job, write.peer_args, write.staged
    if staged is not None and isinstance(staged.destination, RingSpace):
        kv_plan = TransferPlan(
            np.array([staging_ptr + staged.local_offset], dtype=np.uint64),
            np.array([staged.destination.ptr], dtype=np.uint64),
            np.array([staged.nbytes], dtype=np.uint64),
        )
    elif staged is not None:
        assert write.pairing.source is not None
        assert isinstance(staged.destination, PageRows)
        gathered_at = staging_ptr + staged.local_offset
        kv_plan = plan_gathered(
            local, peer_args, write.pairing.source, gathered_at, staged.destination.rows, memory
        )
    else:  # a layer-wise job plans its layers only (they pair with decode's by layer id)
        layers = local if job.layers is None else local.layer_range(*job.layers)
        kv_plan = write.pairing.plan(
            layers, peer_args, job.src_pages, job.page_offset, job.dst_pages, memory
        )
    plans = [kv_plan]
    if job.last and job.src_aux_index is not None and job.dst_aux_index is not None:
        plans.append(
            plan_slots(
                local.aux_buffers,
                peer_args.aux_buffers,
                job.src_aux_index,
                job.dst_aux_index,
                "aux",
            )
        )
    if job.last and job.src_state_indices:
        if len(job.src_state_indices) != len(job.dst_state_indices):
            raise PlanError(
                f"{len(job.src_state_indices)} local state slots but decode gave "
                f"{len(job.dst_state_indices)}"
            )
        equal_tp = local.attn_tp_size == peer_args.attn_tp_size
        route = write.pairing.topology.route(peer_args.attn_tp_rank)
        senders = tuple(source.prefill_rank for source in route.sources)  # not the dummies
        for src_slot, dst_slot in zip(job.src_state_indices, job.dst_state_indices, strict=True):
            if equal_tp:  # whole slots
                plans.append(
                    plan_slots(
                        local.state_buffers, peer_args.state_buffers, src_slot, dst_slot, "state"
                    )
                )
            else:  # this rank's shard of each slot
                plans.append(plan_state_slices(local, peer_args, src_slot, dst_slot, senders))
    if len(plans) == 1:
        return kv_plan
    plan = TransferPlan.concat(*plans, memory=memory)
    if isinstance(memory, PlanArena):
        memory.give_back(kv_plan)  # copied into `plan`
    return plan
