"""sglang 0.5.23's bootstrap routes served by kvbridge's bootstrap service, for an SGLang
decode instance that takes KV from kvbridge prefill ranks (`CommonKVBootstrapServer`,
`disaggregation/common/conn.py`), and the registration each such rank sends there.

A prefill rank registers with `PUT /route` (sglang's JSON keys); a decode asks `GET /route`
with every rank field -1 for the group's settings — sglang's `PrefillServerInfo`, its keys
exactly (sglang's decode builds the dataclass from them and fails on any other) — answered 503
until every rank registered, then once per rank for its control endpoint; `GET /health` answers
200 while the service runs, as sglang's does. Attention TP and data parallelism are served (one
context-parallel and pipeline rank), as kvbridge's SGLang mode maps no other; a group that does
not follow bootstrap rooms has each room's DP rank registered (`POST /register_dp_rank`) and
asked (`POST /query_dp_ranks`), kept as sglang keeps them (`RoomDPRanks`). Stricter than
sglang: a rank whose group settings differ from the first rank's is refused (409) rather than
ignored, and a restarted rank's second registration replaces its first instead of counting
twice. Pure: a request in, a `Reply` out.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

from kvbridge.control.bootstrap import BootstrapError, BootstrapService, Reply
from kvbridge.control.sglang_bootstrap import MAX_DP_SIZE, MAX_GROUP_RANKS, RETRY_S, base_url
from kvbridge.control.sglang_dp import ROOM_ROUTES, RoomDPRanks
from kvbridge.wire.address import host_problem

ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
MAX_ATTN_TP = 1024
# sglang's load_balance_method that makes a room's DP rank its number modulo the DP size; any
# other (round_robin, ...) has the rank that took the room register it.
FOLLOW_ROOMS = "follow_bootstrap_room"
ROUTES = ("/route", "/health", *ROOM_ROUTES)


@dataclass(frozen=True)
class SGLangPrefillRank:
    """What one prefill rank registers (the part of sglang's `PUT /route` body kvbridge
    reads; the rest is sglang's defaults, checked)."""

    attn_tp_rank: int
    attn_tp_size: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str
    attn_dp_rank: int = 0
    attn_dp_size: int = 1
    follow_bootstrap_room: bool = True

    def document(self) -> dict[str, Any]:
        """The `PUT /route` body, as sglang's `register_to_bootstrap` sends it (data
        parallelism as DP attention's: one system DP rank)."""
        document = asdict(self)
        follow = document.pop("follow_bootstrap_room")
        return {
            **document,
            "attn_cp_size": 1,
            "attn_cp_rank": 0,
            "pp_size": 1,
            "pp_rank": 0,
            "system_dp_size": 1,
            "system_dp_rank": 0,
            "load_balance_method": FOLLOW_ROOMS if follow else "round_robin",
        }

    @property
    def group(self) -> tuple[int, int, int, str, bool]:
        """What every rank of one group has alike."""
        return (
            self.attn_tp_size,
            self.attn_dp_size,
            self.page_size,
            self.kv_cache_dtype,
            self.follow_bootstrap_room,
        )

    @staticmethod
    def parse(document: Any) -> SGLangPrefillRank:
        """A registration from its JSON; ValueError naming what is wrong or not served."""
        if not isinstance(document, dict):
            raise ValueError("a registration is a JSON object")
        ints = {}
        for name in ("attn_tp_rank", "attn_tp_size", "rank_port", "page_size"):
            ints[name] = _integer(document, name)
        for name in ("attn_dp_rank", "system_dp_rank"):
            ints[name] = _integer(document, name, 0)
        for name in ("attn_dp_size", "system_dp_size"):
            ints[name] = _integer(document, name, 1)
        if not 0 <= ints["attn_tp_rank"] < ints["attn_tp_size"] <= MAX_ATTN_TP:
            raise ValueError(f"attn_tp_rank {ints['attn_tp_rank']} of {ints['attn_tp_size']}")
        # sglang's server: the DP group is the attention DP rank with one system DP rank,
        # else the system DP rank.
        system = ints["system_dp_size"] != 1
        dp_rank = ints["system_dp_rank" if system else "attn_dp_rank"]
        dp_size = ints["system_dp_size" if system else "attn_dp_size"]
        if not 0 <= dp_rank < dp_size <= MAX_DP_SIZE:
            raise ValueError(f"DP rank {dp_rank} of {dp_size}")
        if dp_size * ints["attn_tp_size"] > MAX_GROUP_RANKS:
            raise ValueError(
                f"DP {dp_size} × TP {ints['attn_tp_size']}: over {MAX_GROUP_RANKS} ranks"
            )
        if not 0 < ints["rank_port"] < 65536 or ints["page_size"] < 1:
            raise ValueError(f"rank_port / page_size out of range: {ints}")
        host, dtype = document.get("rank_ip"), document.get("kv_cache_dtype")
        if not isinstance(host, str) or host_problem(host) is not None:
            raise ValueError(f"rank_ip {str(host)[:100]!r} is not a host")
        if not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
            raise ValueError(f"kv_cache_dtype {str(dtype)[:100]!r} is not a dtype name")
        for name in ("attn_cp_size", "pp_size"):
            if document.get(name, 1) != 1:
                raise ValueError(
                    f"{name} {document.get(name)!r}: only attention TP and DP are served"
                )
        if document.get("decode_allocation_policy", "early") != "early":
            raise ValueError("only decode_allocation_policy 'early' is served")
        balance = document.get("load_balance_method", FOLLOW_ROOMS)
        if not isinstance(balance, str):
            raise ValueError(f"load_balance_method {str(balance)[:100]!r} is not a name")
        return SGLangPrefillRank(
            ints["attn_tp_rank"],
            ints["attn_tp_size"],
            host,
            ints["rank_port"],
            ints["page_size"],
            dtype,
            dp_rank,
            dp_size,
            balance == FOLLOW_ROOMS,
        )


def _integer(document: dict[str, Any], name: str, default: int | None = None) -> int:
    value = document.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}"[:200])
    return value


def server_info(rank: SGLangPrefillRank) -> dict[str, Any]:
    """sglang's `PrefillServerInfo` for the group, as its server sends it (`asdict`, without
    `kv_layout` and `dsv41_spec_layout` when None)."""
    return {
        "attn_tp_size": rank.attn_tp_size,
        "attn_cp_size": 1,
        "dp_size": rank.attn_dp_size,
        "pp_size": 1,
        "page_size": rank.page_size,
        "kv_cache_dtype": rank.kv_cache_dtype,
        "follow_bootstrap_room": rank.follow_bootstrap_room,
        "enable_dsa_cache_layer_split": False,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
        "prefill_http_port": None,
        "target_tp_rank": None,
        "target_tp_ranks": None,
        "target_cp_ranks": None,
        "target_pp_ranks": None,
        "required_dst_info_num": None,
        "required_prefill_response_num": None,
    }


class SGLangRoutes:
    """The prefill group's table and sglang's answers about it."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[int, int], SGLangPrefillRank] = {}  # by (DP rank, TP rank)
        self.rooms = RoomDPRanks()

    @property
    def first(self) -> SGLangPrefillRank | None:
        """The first rank registered: the group's settings, as sglang's server keeps them."""
        return next(iter(self.ranks.values()), None)

    @property
    def complete(self) -> bool:
        first = self.first
        return first is not None and len(self.ranks) == first.attn_tp_size * first.attn_dp_size

    def handle(self, method: str, path: str, body: bytes, now: float) -> Reply:
        route, _, query = path.partition("?")
        if route == "/health":
            if method != "GET":
                return Reply(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "GET /health only"})
            return Reply(HTTPStatus.OK, {"status": "ok", "registered": len(self.ranks)})
        if route in ROOM_ROUTES:
            if method != "POST":
                return Reply(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"POST {route} only"})
            first = self.first
            return self.rooms.handle(route, body, now, first.attn_dp_size if first else MAX_DP_SIZE)
        if method == "PUT":
            return self._register(body)
        if method == "GET":
            return self._lookup(urllib.parse.parse_qs(query))
        return Reply(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"no route {method} /route"})

    def _register(self, body: bytes) -> Reply:
        try:
            rank = SGLangPrefillRank.parse(json.loads(body))
        except (ValueError, RecursionError) as exc:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)[:300]})
        first = self.first
        if first is not None and first.group != rank.group:
            return Reply(
                HTTPStatus.CONFLICT,
                {
                    "error": f"prefill rank {rank.attn_tp_rank} has (attn_tp_size, "
                    "dp_size, page_size, kv_cache_dtype, follow_bootstrap_room) "
                    f"{rank.group}, the group {first.group}"
                },
            )
        self.ranks[rank.attn_dp_rank, rank.attn_tp_rank] = rank
        return Reply(HTTPStatus.OK, {"registered": asdict(rank)})

    def _lookup(self, query: dict[str, list[str]]) -> Reply:
        try:
            dp, cp, tp, pp = (int(query[name][0]) for name in ROUTE_QUERY)
        except (KeyError, ValueError):
            return Reply(
                HTTPStatus.BAD_REQUEST, {"error": f"{', '.join(ROUTE_QUERY)} are all needed"}
            )
        if not self.complete:
            return Reply(
                HTTPStatus.SERVICE_UNAVAILABLE,
                {"error": f"prefill group not fully registered ({len(self.ranks)} ranks)"},
            )
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            first = self.first
            assert first is not None  # the group is complete
            return Reply(HTTPStatus.OK, server_info(first))
        rank = self.ranks.get((dp, tp)) if (cp, pp) == (0, 0) else None
        if rank is None:
            return Reply(
                HTTPStatus.NOT_FOUND, {"error": f"no prefill rank dp {dp} cp {cp} tp {tp} pp {pp}"}
            )
        return Reply(HTTPStatus.OK, {"rank_ip": rank.rank_ip, "rank_port": rank.rank_port})


def register_sglang_prefill(address: str, rank: SGLangPrefillRank, timeout_s: float) -> None:
    """`PUT /route` this rank at an SGLang-speaking bootstrap service (kvbridge's, or sglang's
    own), trying again until `timeout_s`; BootstrapError says why it was not taken."""
    body = json.dumps(rank.document()).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(
            f"{base_url(address)}/route",
            data=body,
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5.0) as response:
                if response.status == HTTPStatus.OK:
                    return
                last = f"{response.status}"
        except urllib.error.HTTPError as exc:
            last = f"{exc.code}: {exc.read().decode('utf-8', 'replace')[:200]}"
            if exc.code in (HTTPStatus.BAD_REQUEST, HTTPStatus.CONFLICT):
                raise BootstrapError(f"SGLang bootstrap {address} refused rank: {last}") from None
        except Exception as exc:  # no answer yet: tried again until the deadline
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise BootstrapError(
                f"SGLang bootstrap {address} did not take prefill rank {rank.attn_tp_rank} in "
                f"{timeout_s:g} s ({last})"
            )
        time.sleep(RETRY_S)


class SGLangBootstrapService(BootstrapService):
    """kvbridge's bootstrap service answering sglang's routes (`ROUTES`) instead of its own;
    no secret (sglang's decode sends no token)."""

    def __init__(self) -> None:
        super().__init__(secret=None)
        self.routes = SGLangRoutes()

    def handle(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        client: str,
        now: float,
    ) -> Reply:
        if path.partition("?")[0] not in ROUTES:
            return Reply(HTTPStatus.NOT_FOUND, {"error": f"no route {method} {path[:100]}"})
        return self.routes.handle(method, path, body, now)
