"""A KV connector that only records what vLLM calls it with (loaded by vLLM through
``kv_connector_module_path``): which hooks run, in which order, with what arguments, and what
vLLM's CPU KV caches look like. Groundwork for kvbridge's vLLM connector (issue 14).

The record goes to the JSON-lines file named by ``kv_connector_extra_config["record"]``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class _Metadata(KVConnectorMetadata):
    pass


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "stride": list(value.stride()),
            "device": str(value.device),
        }
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._path = extra["record"]
        self._record("__init__", role=role.name)

    def _record(self, hook: str, **arguments: Any) -> None:
        line = {"hook": hook, "role": self.role.name, **arguments}
        with open(self._path, "a") as out:
            out.write(json.dumps(line, default=str) + "\n")

    # --- worker side ---
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._record(
            "register_kv_caches",
            layers=list(kv_caches),
            first=_summary(next(iter(kv_caches.values()))),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._record("save_kv_layer", layer=layer_name, kv_layer=_summary(kv_layer))

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if finished_req_ids:
            self._record("get_finished", finished=sorted(finished_req_ids))
        return None, None

    # --- scheduler side ---
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._record(
            "get_num_new_matched_tokens",
            request=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            num_computed_tokens=num_computed_tokens,
            kv_transfer_params=request.kv_transfer_params,
        )
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._record(
            "update_state_after_alloc",
            request=request.request_id,
            block_ids=[list(group) for group in blocks.get_block_ids()],
            num_external_tokens=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._record(
            "build_connector_meta",
            new=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            tokens=dict(scheduler_output.num_scheduled_tokens),
        )
        return _Metadata()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", request=request.request_id, block_ids=block_ids)
        return False, {"recorded": True}
