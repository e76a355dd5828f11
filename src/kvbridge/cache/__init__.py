"""KV-cache geometry (`KVArgs`) and transfer planning (`plan_kv`, `plan_slots`)."""

from kvbridge.cache.plan import PlanError, TransferPlan, page_runs, plan_kv, plan_slots
from kvbridge.cache.spec import DTYPE_SIZES, BufferSpec, GeometryError, KVArgs, kv_heads_on_rank

__all__ = [
    "DTYPE_SIZES",
    "BufferSpec",
    "GeometryError",
    "KVArgs",
    "PlanError",
    "TransferPlan",
    "kv_heads_on_rank",
    "page_runs",
    "plan_kv",
    "plan_slots",
]
