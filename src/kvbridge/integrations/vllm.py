"""kvbridge as a vLLM KV connector, loaded without patching vLLM:

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both"}'

The flow is vLLM's PD flow: a prefill request carries ``kv_transfer_params:
{"do_remote_decode": true}``; the ``kv_transfer_params`` of its output, passed with the decode
request, make the decode instance load the KV and go on generating. Transfers are kvbridge's
push: decode asks for the pages it lacks (a TransferRequest naming its blocks), the prefill
instance writes them and says so; prefill keeps a finished request's blocks until decode has
them, aborted, or `request_timeout_s` passed.

vLLM makes one connector object per role. The scheduler side only keeps books (which requests
send, load, or were aborted) and hands them to the workers in each step's metadata; the
worker side owns kvbridge's managers (engine, control channel, bootstrap service) and reports
finished transfers back through `get_finished`. The pure parts are `vllm_options` (options),
`vllm_requests` (request parameters, step metadata) and `vllm_cache` (KV tensors, blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbridge.integrations.vllm_blocks import GroupKind
from kvbridge.integrations.vllm_handoff import SendOutbox
from kvbridge.integrations.vllm_kv_views import REQUIRED_LAYOUT
from kvbridge.integrations.vllm_load_plan import SchedulerConfig, stream_group
from kvbridge.integrations.vllm_metrics import KVBridgePromMetrics, KVBridgeStats
from kvbridge.integrations.vllm_options import (
    ConnectorOptions,
    OptionsError,
    check_vllm_version,
    log_through_vllm,
    rank_bootstrap_port,
)
from kvbridge.integrations.vllm_scheduler import SchedulerSide
from kvbridge.integrations.vllm_specs import (
    attention_block_size,
    mamba_state,
    streamed_layers,
    transfer_groups,
)
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.integrations.vllm_steps import SendSpec, StepMetadata
from kvbridge.integrations.vllm_worker import WorkerConfig, WorkerSide

if TYPE_CHECKING:
    import torch


def _no_workers(send: SendSpec) -> str:
    return "this instance does not produce KV (kv_role kv_consumer)"


class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's `StepMetadata`, in the class vLLM expects."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """From each prefill worker to its scheduler: where decode finds this instance (the first
    TP rank of each pipeline stage), and where the scheduler hands the worker its sends, with
    the token that proves a send comes from the scheduler (`vllm_handoff`)."""

    bootstrap_url: str | None
    send_inbox: str
    send_token: str = field(repr=False)


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        check_vllm_version(vllm.__version__)
        log_through_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        self.options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        groups, state_layers = transfer_groups(kv_cache_config, vllm_config.cache_config.block_size)
        produces, consumes = bool(transfer.is_kv_producer), bool(transfer.is_kv_consumer)
        stages = int(parallel.pipeline_parallel_size)
        if stages > 1 and (consumes or len(groups) > 1):
            raise RuntimeError(
                "kvbridge moves the KV of a pipeline-parallel prefill instance (kv_producer, "
                "one KV cache group) to decode instances without pipeline parallelism; this "
                f"one has pipeline_parallel_size {stages}, kv_role {transfer.kv_role}, "
                f"{len(groups)} KV cache group(s)"
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._outbox: SendOutbox | None = None
        if role == KVConnectorRole.SCHEDULER:
            if produces:
                self._outbox = SendOutbox()
            config = SchedulerConfig(
                str(transfer.engine_id),
                produces,
                groups,
                stages,
                self.options.manager.request_timeout_s,
            )
            self._scheduler = SchedulerSide(
                config, self._outbox.send if self._outbox is not None else _no_workers
            )
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        # Each data-parallel rank and pipeline stage of a prefill instance serves its own
        # bootstrap service.
        stage = int(get_pp_group().rank_in_group)
        port = self.options.manager.bootstrap_port
        if port:
            port = rank_bootstrap_port(port, int(parallel.data_parallel_index), stages, stage)
        vllm_groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else [None]
        self._worker = WorkerSide(
            WorkerConfig(
                produces=produces,
                consumes=consumes,
                tp_rank=int(get_tensor_model_parallel_rank()),
                tp_size=int(parallel.tensor_parallel_size),
                pp_rank=stage,
                total_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
                use_mla=bool(vllm_config.model_config.use_mla),
                block_size=attention_block_size(groups),
                state_layers=state_layers,
                state_groups=frozenset(
                    index for index, group in enumerate(groups) if group.kind == GroupKind.STATE
                ),
                stream_layers=streamed_layers(kv_cache_config, stream_group(groups, stages)),
                mamba=mamba_state(
                    kv_cache_config,
                    vllm_config.model_config.hf_text_config,
                    int(parallel.tensor_parallel_size),
                ),
                num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else None,
                bootstrap_port=port,
                # vLLM takes failed loads by block only from a model of one KV cache group.
                multi_group=len(vllm_groups) > 1,
            ),
            self.options,
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The `kv_cache_layout` option; else head-major pages (LBHNC), which move whole or by
        head slices, and for MLA, whose one latent head is the same in any layout, vLLM's
        choice. Options that do not parse are left to the connector's constructor to report."""
        transfer = vllm_config.kv_transfer_config
        try:
            options = ConnectorOptions.from_extra_config(
                None if transfer is None else transfer.kv_connector_extra_config
            )
        except OptionsError:
            options = ConnectorOptions()
        if options.kv_cache_layout is not None:
            return options.kv_cache_layout
        model = vllm_config.model_config
        return None if model is not None and model.use_mla else REQUIRED_LAYOUT

    # --- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        worker = self._worker_side
        if worker.inbox is None:  # not a prefill worker
            return None
        return KVBridgeHandshake(worker.bootstrap_url, worker.inbox.address, worker.inbox.token)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side.start(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its KV is in place

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVBridgeMetadata):  # before the forward
            step = connector_metadata.step
            self._worker_side.begin_step(step.streams, step.stream_aborts)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Decode first: the layer's KV is in place (CPU attention is synchronous), so it goes
        # out while the next layers compute. Otherwise prefill writes finished requests'
        # blocks when decode asks for them.
        self._worker_side.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        metadata = self._step_metadata() if self.has_connector_metadata() else StepMetadata()
        return self._worker_side.finished(metadata.idle)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, loaded = self.get_finished(finished_req_ids)
        # With several KV cache groups vLLM takes failed loads by request, not by block.
        return KVConnectorTransferResults(
            set(sent or ()), set(loaded or ()), self._worker_side.take_failed_loads()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None

    def counters(self) -> ConnectorCounters:
        """This worker's transfer counters."""
        return self._worker_side.counters

    @property
    def kv_caches(self) -> dict[str, Any]:
        """The KV tensors vLLM registered, by layer name (for inspection)."""
        return self._worker_side.kv_caches

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        # Workers report what they moved; the scheduler how many requests are in flight.
        if self._worker is not None:
            data = self._worker.take_interval()
        else:
            data = self._scheduler_side.take_gauges()
        return KVBridgeStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side --------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware(
            {(0, rank): meta for rank, meta in metadata.items()}
        )

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        # Each pipeline stage's first TP rank serves the stage's bootstrap service; every
        # worker takes sends.
        for (stage, tp_rank), handshake in metadata.items():
            if not isinstance(handshake, KVBridgeHandshake):
                continue
            if tp_rank == 0 and handshake.bootstrap_url is not None:
                self._scheduler_side.bootstrap_urls[stage] = handshake.bootstrap_url
            if self._outbox is not None:
                self._outbox.connect((stage, tp_rank), handshake.send_inbox, handshake.send_token)

    def on_new_request(self, request: Any) -> None:
        self._scheduler_side.on_new_request(request, time.monotonic())

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self._scheduler_side.matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load fills the request's own blocks of every group that moves (none is zeroed
        # under it).
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = self._transfer_blocks(blocks.get_block_ids())
        self._scheduler_side.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        idle = int(scheduler_output.total_num_scheduled_tokens) == 0
        scheduler = self._scheduler_side
        if scheduler.streams.active:  # decode first: the blocks this step's forward completes
            manager = self._kv_cache_manager
            scheduler.stream_step(
                scheduler_output.num_scheduled_tokens,
                lambda request_id: self._transfer_blocks(manager.get_block_ids(request_id)),
                set(scheduler_output.preempted_req_ids or ()),
            )
        return KVBridgeMetadata(scheduler.take_step(idle, time.monotonic()))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side.on_output(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
        )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.finished(request, self._transfer_blocks(block_ids))

    def has_pending_push_work(self) -> bool:
        # Keeps a prefill engine stepping while decode instances still have blocks to fetch,
        # so that get_finished frees them when they are done.
        return self._scheduler is not None and self._scheduler.pending

    # --- plumbing --------------------------------------------------------------------------

    def _transfer_blocks(self, block_ids: Any) -> tuple[list[int], ...]:
        """A request's block ids of the groups that take part in transfers."""
        if self._kv_cache_config is None:
            return tuple(list(ids) for ids in block_ids)
        return tuple(self._kv_cache_config.select_transfer_block_ids(block_ids))

    def _step_metadata(self) -> StepMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVBridgeMetadata)
        return metadata.step

    @property
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side hook was called on the scheduler's connector")
        return self._worker

    @property
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on a worker's connector")
        return self._scheduler
