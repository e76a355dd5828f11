"""Prefill's sends on one worker of kvbridge's vLLM connector: each finished request's room
at this pipeline stage, opened the moment the scheduler hands it over (`vllm_handoff`, on the
inbox's thread), polled on the engine's step until decode has the pages or the room failed,
and counted. `vllm_worker.WorkerSide` owns the `Sends` and lends it the prefill manager and
the KV cache. No vLLM import."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvbridge.integrations.vllm_cache import VLLMCache
from kvbridge.integrations.vllm_requests import stage_room
from kvbridge.integrations.vllm_stats import ConnectorCounters, Interval
from kvbridge.integrations.vllm_steps import SendSpec
from kvbridge.prefill import KVSender, PrefillManager
from kvbridge.wire.messages import FailureKind, KVPoll

log = logging.getLogger("kvbridge.vllm")


@dataclass
class _Send:
    """One request's send: the sender of its room at this pipeline stage (None if it could
    not be made), and its block count."""

    sender: KVSender | None
    blocks: int


class Sends:
    def __init__(
        self,
        counters: ConnectorCounters,
        interval: Interval,
        pipeline_stage: int,
        state_groups: frozenset[int],
    ) -> None:
        self._counters = counters
        self._interval = interval
        self._stage = pipeline_stage
        self._state_groups = state_groups
        # Filled on the send inbox's thread, emptied on the engine's (`poll`).
        self._sends: dict[str, _Send] = {}
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return len(self._sends)

    def start(self, send: SendSpec, prefill: PrefillManager, cache: VLLMCache) -> None:
        """A finished request's blocks, for decode to ask for: this stage's room holds its
        layers of every group."""
        sender: KVSender | None = None
        try:
            contents = cache.send_contents(send.blocks, self._state_groups)
            sender = prefill.sender(stage_room(send.room, self._stage))
            sender.send(
                contents.pages,
                last=True,
                state_indices=contents.slots,
                positional=contents.positional,
            )
        except Exception as exc:  # (a room id that ended here before): the blocks are freed
            log.error("request %s: not sent: %r", send.request_id, exc)
            if sender is not None:
                sender.abort(repr(exc))
        with self._lock:
            self._sends[send.request_id] = _Send(sender, sum(map(len, send.blocks)))
        prefill.activity.set()  # an idle step waiting on sends looks again

    def adopt(self, request_id: str, sender: KVSender | None, blocks: int) -> None:
        """A room opened while the request ran (decode first), polled from now on as if it
        started here."""
        with self._lock:
            self._sends[request_id] = _Send(sender, blocks)

    def poll(self) -> set[str]:
        """The requests whose send ended (decode has the pages, or it failed) since the last
        poll: their blocks may be freed."""
        sent: set[str] = set()
        with self._lock:
            sends = list(self._sends.items())
        for request_id, send in sends:
            sender = send.sender
            if sender is not None and not sender.pages_safe:
                continue
            if sender is None or sender.poll() == KVPoll.Failed:
                kind = sender.failure_kind if sender is not None else FailureKind.INTERNAL
                reason = f"{sender.failure_reason} [{kind}]" if sender else "no room"
                log.warning("request %s: not sent: %s", request_id, reason)
                self._counters.sends_failed += 1
                if kind == FailureKind.TIMEOUT and sender is not None and not sender.asked:
                    self._counters.sends_expired += 1  # its lease ran out: nobody claimed it
                elif kind != FailureKind.ABORTED:  # decode gave it up: not a failure
                    self._interval.fail("send", kind)
            else:
                self._counters.requests_sent += 1
                self._counters.pages_sent += send.blocks
            if sender is not None:
                sender.clear()
            with self._lock:
                del self._sends[request_id]
            sent.add(request_id)
        return sent
