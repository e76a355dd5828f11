"""The scheduler side of kvbridge's vLLM connector: book-keeping only (which requests send,
load or were given up), handed to the workers in each step's metadata. It reads vLLM's
request objects but imports nothing from vLLM; `kvbridge.integrations.vllm` builds it."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvbridge.integrations.vllm_blocks import LoadPlanError, blocks_to_send, from_position_zero
from kvbridge.integrations.vllm_load_plan import (
    SchedulerConfig,
    decode_first_remote,
    plan_load,
    unloaded_blocks,
)
from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.integrations.vllm_requests import RemotePrefill, tokens_to_load
from kvbridge.integrations.vllm_stats import LOADS_IN_FLIGHT, SENDS_IN_FLIGHT
from kvbridge.integrations.vllm_steps import LoadSpec, SendSpec, StepMetadata, StreamAbort
from kvbridge.integrations.vllm_streamed import StreamBook, Streamed, streamed_room

log = logging.getLogger("kvbridge.vllm")

# The request states after which a prefill request's KV is complete (vLLM's
# FINISHED_LENGTH_CAPPED and FINISHED_STOPPED, by name: no vLLM import here).
SENDABLE = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


def _no_hand_off(send: SendSpec) -> str | None:
    return "this scheduler side hands sends to no worker"


class SchedulerSide:
    def __init__(
        self,
        config: SchedulerConfig,
        hand_off: Callable[[SendSpec], str | None] = _no_hand_off,
    ) -> None:
        """`hand_off` gives a finished prefill request's send to the workers at once (why it
        could not, else None): no engine step need follow (`vllm_handoff`)."""
        self.config = config
        self._hand_off = hand_off
        # Each pipeline stage's bootstrap service, from its first TP rank's handshake.
        self.bootstrap_urls: dict[int, str] = {}
        self._step = StepMetadata()
        self._computed: dict[str, int] = {}  # decode request → tokens in the local prefix
        self._sending: set[str] = set()
        self._loading: set[str] = set()
        self._refused: set[str] = set()  # requests whose parameters were malformed (logged)
        self._truncated: set[str] = set()  # prefill requests cut `backoff` tokens short
        self._reported_gauges: dict[str, int] = {}
        # Decode: requests whose rooms on prefill decode renews, with when it last did (or
        # they arrived): those waiting in the queue for their load, and decode-first loads
        # in flight (prefill's scheduler may not have reached the request yet).
        self._waiting: dict[str, tuple[RemotePrefill, float]] = {}
        # Prefill, decode first: requests streamed into their rooms as they are computed.
        self.streams = StreamBook(config.groups, config.stream_group or 0)

    @property
    def pending(self) -> bool:
        return bool(self._sending or self._loading)

    def take_gauges(self) -> dict[str, int]:
        """Requests in flight each way (`vllm_stats`), if they changed since the last call."""
        gauges = {SENDS_IN_FLIGHT: len(self._sending), LOADS_IN_FLIGHT: len(self._loading)}
        if gauges == self._reported_gauges:
            return {}
        self._reported_gauges = gauges
        return gauges

    def _remote(self, request: Any) -> RemotePrefill | None:
        """The remote prefill a request names; None for none, or for malformed parameters
        (a client's input: the request is then computed here, the engine goes on)."""
        try:
            return RemotePrefill.from_params(request.kv_transfer_params)
        except OptionsError as exc:
            if request.request_id not in self._refused:
                self._refused.add(request.request_id)
                log.warning("request %s: computed locally: %s", request.request_id, exc)
            return None

    def on_new_request(self, request: Any, now: float = 0.0) -> None:
        """Decode: a request that will load from a prefill instance with a lease waits with
        it renewed (`take_step`). Prefill: a request for a remote decode stops `backoff`
        tokens short of its prompt (decode computes those), and makes one token."""
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            remote = self._remote(request)
            if remote is not None and remote.lease_s > 0:
                self._waiting[request.request_id] = (remote, now)
        if self.config.produces and self.config.streams:
            self.streams.opened(request)
        backoff = self.config.backoff
        if (
            not backoff
            or not self.config.produces
            or not isinstance(params, dict)
            or not params.get("do_remote_decode")
            or request.request_id in self._truncated
            or request.num_prompt_tokens <= backoff
            or request.prompt_token_ids is None
        ):
            return  # decode refuses a load whose prefill did not stop short (plan_load)
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        self._truncated.add(request.request_id)  # once, whatever rescheduling follows

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        remote = self._remote(request)
        if remote is None or not params.get("do_remote_prefill"):
            return 0, False
        if remote.decode_first:
            remote = decode_first_remote(self.config, remote, request.num_prompt_tokens)
        count = tokens_to_load(remote, request.num_prompt_tokens, num_computed)
        if request.num_prompt_tokens <= self.config.backoff:
            count = 0  # too short for prefill to stop short: computed here
        self._computed[request.request_id] = num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Decode: the request's blocks are allocated (`block_ids`: per transfer group, by
        block position): plan the load of the `num_external_tokens` after its local prefix."""
        params = request.kv_transfer_params
        remote = self._remote(request)
        if remote is None or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not remote.decode_first:
            self._waiting.pop(request.request_id, None)  # it asks (or releases) now
        prefix = self._computed.pop(request.request_id, 0)
        if num_external_tokens == 0:  # every token is in the local prefix cache
            self._waiting.pop(request.request_id, None)
            self._step.releases.append(remote)
            return
        if remote.decode_first:
            remote = decode_first_remote(self.config, remote, request.num_prompt_tokens)
        try:
            load = plan_load(self.config, request, remote, block_ids, prefix, num_external_tokens)
        except LoadPlanError as exc:  # a load that cannot be right fails at once
            load = LoadSpec(
                request.request_id,
                remote,
                unloaded_blocks(self.config.groups, block_ids, prefix),
                (),
                str(exc),
            )
        self._step.loads.append(load)
        self._loading.add(request.request_id)

    def stream_step(
        self,
        scheduled: Mapping[str, int],
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
        preempted: AbstractSet[str] = frozenset(),
    ) -> None:
        """Prefill, decode first: the blocks each streamed request's forward completes in
        this step (`scheduled`: tokens per request), for the workers to write by layer; the
        rooms of preempted ones fail."""
        self._step.stream_aborts.update(self.streams.preempted(preempted))
        specs, stopped = self.streams.step(scheduled, block_ids_of)
        self._step.streams += specs
        self._step.stream_aborts.update(stopped)

    def finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (`block_ids`: per transfer group); prefill keeps the blocks of one
        that a decode instance will load, and says where in its kv_transfer_params."""
        params = request.kv_transfer_params or {}
        request_id = request.request_id
        self._computed.pop(request_id, None)
        self._truncated.discard(request_id)
        self._waiting.pop(request_id, None)
        if request_id in self._loading:
            # Ended while its load is in flight (the client went away): the blocks stay until
            # no prefill write can land in them.
            self._step.aborts.append(request_id)
            return True, None
        remote = self._remote(request)
        self._refused.discard(request_id)
        if remote is not None and params.get("do_remote_prefill"):
            self._step.releases.append(remote)  # ended before it was scheduled
            return False, None
        if not params.get("do_remote_decode") or not self.config.produces:
            return False, None
        streamed = self.streams.ended(request_id)
        chosen = streamed_room(params)  # decode first: the proxy's room, decode asks there
        if request.status.name not in SENDABLE:
            return self._not_sent(streamed, chosen, request_id, f"ended {request.status.name}")
        stages = [self.bootstrap_urls.get(stage) for stage in range(self.config.pipeline_stages)]
        if None in stages:
            log.error("request %s: no bootstrap service on this instance", request_id)
            return self._not_sent(streamed, chosen, request_id, "no bootstrap service")
        urls = tuple(url for url in stages if url is not None)
        groups, tokens = self.config.groups, request.num_computed_tokens
        try:
            sent = blocks_to_send(groups, block_ids, tokens)
            # Decode first: decode planned the room before prefill's sliding windows dropped
            # any block, so positions count from 0 (dropped ones marked, never written).
            moving = (
                tuple(g.blocks for g in sent)
                if chosen is None
                else from_position_zero(groups, sent, tokens)
            )
        except ValueError as exc:  # vLLM's block table is not what kvbridge expects
            log.error("request %s: not sent: %s", request_id, exc)
            return self._not_sent(streamed, chosen, request_id, str(exc))
        if not any(group.blocks for group in sent):
            return self._not_sent(streamed, chosen, request_id, "no blocks")
        room = chosen if chosen is not None else secrets.randbits(63)
        spec = SendSpec(request_id, room, moving, streamed is not None)
        problem = self._hand_off(spec)
        if problem is not None:
            log.error("request %s: not sent: %s", request_id, problem)
            if streamed is not None:  # its worker fails the room at its next step
                self._step.stream_aborts[request_id] = StreamAbort(
                    streamed.room, f"not sent: {problem}"
                )
            return False, None
        self._sending.add(request_id)
        remote = RemotePrefill(
            urls[0],
            room,
            request.num_computed_tokens,
            self.config.engine_id,
            request_id,
            tuple((group.first, len(group.blocks)) for group in sent),
            tuple(group.block_size for group in self.config.groups),
            urls,
            self.config.lease_s,
        )
        return True, remote.to_params()

    def _not_sent(
        self, streamed: Streamed | None, chosen: int | None, request_id: str, why: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request that will not be sent. Decode first (`chosen`: the proxy's room, decode
        may be waiting on it) the worker fails the room, so decode hears at once rather than
        at prefill's claim deadline; a stream written in part while it ran keeps its blocks
        until no write of it reads them."""
        if streamed is not None:
            room = streamed.room
        elif chosen is not None:
            room = chosen
        else:
            return False, None
        aborted = f"the prefill request {why}"
        spec = SendSpec(request_id, room, ((),), streamed=streamed is not None, aborted=aborted)
        if self._hand_off(spec) is not None:  # the worker's inbox is gone: so is its engine
            if streamed is not None:
                self._step.stream_aborts[request_id] = StreamAbort(room, f"not sent: {aborted}")
            return False, None
        self._sending.add(request_id)
        return True, None

    def take_step(self, idle: bool, now: float = 0.0) -> StepMetadata:
        """This step's metadata. Once any request whose room decode renews (waiting in its
        queue, or a decode-first load in flight) is due (every third of its lease), all of
        them renew: one message per prefill instance, not one per request per step."""
        step, self._step = self._step, StepMetadata()
        step.idle = idle and self.pending
        waiting = self._waiting
        if any(now - renewed >= remote.lease_s / 3 for remote, renewed in waiting.values()):
            step.renewals = [remote for remote, _ in waiting.values()]
            self._waiting = {
                request_id: (remote, now) for request_id, (remote, _) in waiting.items()
            }
        return step

    def on_output(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        self._sending.difference_update(finished_sending)
        self._loading.difference_update(finished_recving)
        for request_id in finished_recving:
            self._waiting.pop(request_id, None)
