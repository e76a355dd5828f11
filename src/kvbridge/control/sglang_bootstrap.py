"""sglang 0.5.23's bootstrap service, as a decode rank asks it (`CommonKVBootstrapServer`,
`disaggregation/common/conn.py`): `GET /route` with every rank field -1 for the prefill
group's settings (503 until every prefill rank registered), then once per prefill rank for its
control endpoint (of every data-parallel rank). An SGLang bootstrap address is `host:port`,
without a scheme. Its `GET /health` is how a decode rank knows the group is alive
(`HealthPoller`); which DP rank prefills a room is `SGLangPrefillGroup.dp_rank_of`'s, or asked
(control/sglang_dp.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kvbridge.control.bootstrap import BootstrapError
from kvbridge.wire.address import host_problem, tcp_endpoint

# What the group's answer must carry (sglang's PrefillServerInfo), with its type.
GROUP_FIELDS = {
    "attn_tp_size": int,
    "attn_cp_size": int,
    "dp_size": int,
    "pp_size": int,
    "page_size": int,
    "kv_cache_dtype": str,
}
RETRY_S = 0.2


MAX_DP_SIZE = 1024
MAX_GROUP_RANKS = 4096  # DP × attention TP: a decode rank asks each rank's route once


@dataclass(frozen=True)
class SGLangPrefillGroup:
    """An SGLang prefill group as one decode rank uses it: its attention-TP ranks, once per
    data-parallel rank."""

    address: str  # host:port of its bootstrap service
    attn_tp_size: int
    page_size: int
    kv_cache_dtype: str
    endpoints: tuple[tuple[str, ...], ...]  # [DP rank][attention-TP rank]: control endpoint
    # Whether a room's DP rank is its number modulo the DP size (sglang's default load
    # balancing); otherwise the prefill rank that took the room registers it.
    follow_bootstrap_room: bool = True

    @property
    def dp_size(self) -> int:
        return len(self.endpoints)

    @property
    def every_endpoint(self) -> tuple[str, ...]:
        return tuple(endpoint for ranks in self.endpoints for endpoint in ranks)

    def dp_rank_of(
        self, room: int, given: int | None = None, force_query: bool = False
    ) -> int | None:
        """Which DP rank prefills `room`, as sglang's decode decides it
        (`_resolve_prefill_dp_rank`): the one the caller was given, the only one, the room
        modulo the DP size where the group follows bootstrap rooms (and `force_query`, sglang's
        switch for mixed routing, is off); None: ask the bootstrap service (`POST
        /query_dp_ranks`). ValueError for a given rank outside the group."""
        if given is not None:
            if not 0 <= given < self.dp_size:
                raise ValueError(
                    f"prefill DP rank {given}: the SGLang group at {self.address} has "
                    f"{self.dp_size}"
                )
            return given
        if self.dp_size == 1:
            return 0
        if self.follow_bootstrap_room and not force_query:
            return room % self.dp_size
        return None


def base_url(address: str) -> str:
    """`http://host:port` for sglang's `host:port` (a URL given whole is kept)."""
    return address.rstrip("/") if "://" in address else f"http://{address}"


def _get(url: str, timeout_s: float) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")[:200]
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body.decode("utf-8", "replace")[:200]


def _route(address: str, dp: int, cp: int, tp: int, pp: int) -> str:
    query = urllib.parse.urlencode(
        {"prefill_dp_rank": dp, "prefill_cp_rank": cp, "target_tp_rank": tp, "target_pp_rank": pp}
    )
    return f"{base_url(address)}/route?{query}"


def parse_group(address: str, document: Any) -> dict[str, Any]:
    """The group's settings, checked; ValueError naming what is wrong or not supported."""
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {str(document)[:100]!r}")
    settings: dict[str, Any] = {}
    for name, kind in GROUP_FIELDS.items():
        value = document.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
        settings[name] = value
    for name in ("attn_cp_size", "pp_size"):
        if settings[name] != 1:
            raise ValueError(
                f"the prefill group has {name} {settings[name]}: kvbridge's SGLang mode maps "
                "attention TP and DP only (no prefill context or pipeline parallelism yet)"
            )
    if (
        not 1 <= settings["attn_tp_size"] <= 1024
        or not 1 <= settings["dp_size"] <= MAX_DP_SIZE
        or settings["page_size"] < 1
        or settings["attn_tp_size"] * settings["dp_size"] > MAX_GROUP_RANKS
    ):
        raise ValueError(f"attn_tp_size / dp_size / page_size out of range: {settings}")
    follow = document.get("follow_bootstrap_room", True)
    if not isinstance(follow, bool):
        raise ValueError(f"follow_bootstrap_room must be a bool, got {follow!r}"[:200])
    settings["follow_bootstrap_room"] = follow
    # What sglang's own decode refuses, or would read otherwise than this rank asks.
    policy = document.get("decode_allocation_policy", "early")
    if policy != "early":
        raise ValueError(
            f"the prefill group's decode_allocation_policy is {policy!r}: its successes then "
            "go only to decode ranks that announced each room (BOOTSTRAP); kvbridge asks "
            "with policy 'early'"
        )
    if document.get("enable_kv_cache_sharding"):
        raise ValueError(
            "the prefill group shards its KV cache across ranks (enable_kv_cache_sharding): "
            "not mapped by kvbridge's SGLang mode"
        )
    for name in ("kv_layout", "dsv41_spec_layout"):
        if document.get(name) is not None:
            raise ValueError(f"the prefill group has {name} {document[name]!r}: not supported")
    return settings


def parse_rank(document: Any) -> str:
    """A prefill rank's control endpoint from its `/route` answer."""
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {str(document)[:100]!r}")
    host, port = document.get("rank_ip"), document.get("rank_port")
    if not isinstance(host, str) or host_problem(host) is not None:
        raise ValueError(f"rank_ip {host!r} is not a host")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"rank_port {port!r} is not a TCP port")
    return tcp_endpoint(host, port)


def lookup_sglang_group(address: str, timeout_s: float = 30.0) -> SGLangPrefillGroup:
    """The prefill group behind an SGLang bootstrap address, waiting (up to `timeout_s`) until
    every rank registered; BootstrapError says why not."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            status, document = _get(_route(address, -1, -1, -1, -1), 5.0)
        except Exception as exc:  # no answer, or a broken one: tried again until the deadline
            status, last = 0, f"{type(exc).__name__}: {exc}"
        if status == HTTPStatus.OK:
            break
        if status:
            last = f"{status}: {document}"
        if status == HTTPStatus.BAD_REQUEST or time.monotonic() >= deadline:
            raise BootstrapError(
                f"SGLang prefill group at {address} not ready after {timeout_s:g} s ({last})"
            )
        time.sleep(RETRY_S)
    try:
        settings = parse_group(address, document)
    except ValueError as exc:
        raise BootstrapError(f"SGLang bootstrap {address}: {exc}") from None
    endpoints = tuple(
        tuple(_rank_endpoint(address, dp, rank) for rank in range(settings["attn_tp_size"]))
        for dp in range(settings["dp_size"])
    )
    return SGLangPrefillGroup(
        address,
        settings["attn_tp_size"],
        settings["page_size"],
        settings["kv_cache_dtype"],
        endpoints,
        settings["follow_bootstrap_room"],
    )


def _rank_endpoint(address: str, dp: int, rank: int) -> str:
    name = f"prefill rank {rank}" if dp == 0 else f"prefill DP {dp} rank {rank}"
    try:
        status, answer = _get(_route(address, dp, 0, rank, 0), 5.0)
    except Exception as exc:
        raise BootstrapError(f"SGLang bootstrap {address}: {name}: {exc}") from None
    if status != HTTPStatus.OK:
        raise BootstrapError(f"SGLang bootstrap {address}: {name}: {status} {answer}")
    try:
        return parse_rank(answer)
    except ValueError as exc:
        raise BootstrapError(f"SGLang bootstrap {address}: {name}: {exc}") from None


def healthy(address: str, timeout_s: float) -> bool:
    """Whether the SGLang bootstrap service answers `GET /health` with 200 (anything else that
    comes back, a broken HTTP answer included, is no answer)."""
    try:
        with urllib.request.urlopen(f"{base_url(address)}/health", timeout=timeout_s) as response:
            return bool(response.status == HTTPStatus.OK)
    except Exception:
        return False


class HealthPoller:
    """Asks the bootstrap service of every SGLang prefill group this rank uses for `/health`,
    every `interval_s`, on a thread of its own; each answer is a sign of life of the group's
    ranks (`on_answer` gets their endpoints). SGLang ranks send no heartbeats: sglang's own
    decode watches its prefill instance this way (every 5 s, two misses)."""

    def __init__(
        self,
        groups: Callable[[], list[SGLangPrefillGroup]],
        on_answer: Callable[[tuple[str, ...]], None],
        interval_s: float,
    ) -> None:
        self._groups, self._on_answer = groups, on_answer
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name="kvbridge-decode-sglang-health", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        timeout_s = min(max(self._interval_s, 0.2), 2.0)
        while not self._stop.wait(self._interval_s):
            for group in self._groups():
                if healthy(group.address, timeout_s):
                    self._on_answer(group.every_endpoint)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5.0)
