"""Which data-parallel rank of an SGLang prefill group took a room, where the group does not
follow bootstrap rooms: the prefill rank that opened the room registered it with the group's
bootstrap service (`POST /register_dp_rank`), and a decode rank asks for a batch of rooms at once
(`POST /query_dp_ranks`, sglang 0.5.23's `CommonKVReceiver.query_prefill_dp_ranks`). A room
that is not registered yet is asked again until its deadline: its prefill may not have opened
it yet. `DPRankQueries` asks on a thread of its own, so no scheduler waits on it."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kvbridge.control.bootstrap import Reply
from kvbridge.control.sglang_bootstrap import base_url

log = logging.getLogger("kvbridge.decode")

QUERY_INTERVAL_S = 0.01  # between two batches to one bootstrap service
QUERY_TIMEOUT_S = 5.0  # one HTTP query (sglang's own)
MAX_ROOMS_PER_QUERY = 4096  # rooms this rank asks for in one body (more: several bodies)
MAX_ROOM = 2**64  # sglang's bootstrap rooms are 64-bit
# sglang's switch that makes its decode ask even where rooms follow their number, and its
# prefill register every room: mixed routing (a router that places some rooms itself).
FORCE_QUERY_VARIABLE = "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"


def force_query() -> bool:
    """Whether sglang's FORCE_QUERY_PREFILL_DP_RANK switch is on in this process, read as
    sglang reads a boolean variable."""
    return os.environ.get(FORCE_QUERY_VARIABLE, "").strip().lower() in ("1", "true", "yes", "y")


# What a room's asker hears: its DP rank, or why there is none.
DPRankAnswer = Callable[[int | None, str | None], None]
# How long a registered room's DP rank is kept (sglang's
# SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL), and how many at most: the oldest
# go first under a flood.
ROOM_ROUTES = ("/register_dp_rank", "/query_dp_ranks")  # served by `RoomDPRanks`
ROOM_ENTRY_S = 120.0
MAX_ROOM_ENTRIES = 1 << 18


class RoomDPRanks:
    """The bootstrap service's table of rooms and the DP rank that took each, as sglang's
    server keeps it (`/register_dp_rank`, `/query_dp_ranks`; a query of any number of rooms
    the body limit lets in). Pure: a request in, a reply out."""

    def __init__(self) -> None:
        self._ranks: dict[int, tuple[int, float]] = {}  # room → (DP rank, registered at)

    def __len__(self) -> int:
        return len(self._ranks)

    def handle(self, route: str, body: bytes, now: float, dp_size: int) -> Reply:
        """`dp_size`: the instance's, as registered (a rank outside it is refused)."""
        try:
            document = json.loads(body)
            if not isinstance(document, dict):
                raise ValueError("expected a JSON object")
            if route == "/register_dp_rank":
                return self._register(document, now, dp_size)
            return self._query(document, now)
        except (ValueError, RecursionError) as exc:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)[:300]})

    def _register(self, document: dict[str, Any], now: float, dp_size: int) -> Reply:
        room = _natural(document, "bootstrap_room", MAX_ROOM)
        rank = _natural(document, "dp_rank", dp_size)
        self._expire(now)
        self._ranks.pop(room, None)  # a room registered again is the newest
        self._ranks[room] = (rank, now)
        while len(self._ranks) > MAX_ROOM_ENTRIES:
            del self._ranks[next(iter(self._ranks))]
        return Reply(HTTPStatus.OK, {"registered": room})

    def _query(self, document: dict[str, Any], now: float) -> Reply:
        rooms = document.get("bootstrap_rooms")
        if not isinstance(rooms, list):
            raise ValueError("bootstrap_rooms must be a list")
        self._expire(now)
        found = {}
        for room in rooms:
            if not isinstance(room, int) or isinstance(room, bool):
                raise ValueError(f"a bootstrap room must be an integer, got {room!r}"[:200])
            entry = self._ranks.get(room)
            if entry is not None:
                found[str(room)] = entry[0]
        return Reply(HTTPStatus.OK, found)

    def _expire(self, now: float) -> None:
        while self._ranks:
            room, (_, at) = next(iter(self._ranks.items()))
            if now - at <= ROOM_ENTRY_S:
                return
            del self._ranks[room]


def _natural(document: dict[str, Any], name: str, below: int) -> int:
    value = document.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < below:
        raise ValueError(f"{name} must be an integer from 0 to {below - 1}, got {value!r}"[:200])
    return value


def register_dp_rank(address: str, room: int, dp_rank: int) -> None:
    """`POST /register_dp_rank`: this prefill DP rank took `room` (as sglang's sender does
    before its bootstrap); raises what the request raised."""
    request = urllib.request.Request(
        f"{base_url(address)}/register_dp_rank",
        data=json.dumps({"bootstrap_room": room, "dp_rank": dp_rank}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=QUERY_TIMEOUT_S) as response:
        if response.status != HTTPStatus.OK:
            raise ValueError(f"{response.status}")


def parse_dp_ranks(document: Any, rooms: list[int], dp_size: int) -> dict[int, int | str]:
    """The rooms of `rooms` the answer names: each its DP rank, or (a string) why the rank it
    was given cannot be one of the group's. ValueError for an answer that is not sglang's (a
    JSON object of room → DP rank)."""
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {str(document)[:100]!r}")
    found: dict[int, int | str] = {}
    for room in rooms:
        rank = document.get(str(room))
        if rank is None:
            continue
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp_size:
            found[room] = f"named DP rank {rank!r} for it, of a group of {dp_size}"[:200]
        else:
            found[room] = rank
    return found


def query_dp_ranks(address: str, rooms: list[int], dp_size: int) -> dict[int, int | str]:
    """One `POST /query_dp_ranks` for `rooms`: those the service names (`parse_dp_ranks`).
    Raises what the request or its answer raised (ValueError for an answer not sglang's)."""
    request = urllib.request.Request(
        f"{base_url(address)}/query_dp_ranks",
        data=json.dumps({"bootstrap_rooms": rooms}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=QUERY_TIMEOUT_S) as response:
        if response.status != HTTPStatus.OK:
            raise ValueError(f"{response.status}")
        document = json.loads(response.read())
    return parse_dp_ranks(document, rooms, dp_size)


@dataclass
class _Asked:
    address: str
    room: int
    dp_size: int
    deadline: float
    answer: DPRankAnswer
    last_problem: str = "not registered yet"


class DPRankQueries:
    """Rooms waiting for their prefill DP rank, asked in batches per bootstrap service until
    answered or `timeout_s` passed (then the answer is None with the reason)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._waiting: list[_Asked] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvbridge-sglang-dp", daemon=True)
        self.thread.start()

    def ask(self, address: str, room: int, dp_size: int, answer: DPRankAnswer) -> None:
        """`answer(dp_rank, None)` once the service names the room's DP rank, or `answer(None,
        reason)`; called on this object's thread."""
        asked = _Asked(address, room, dp_size, time.monotonic() + self._timeout_s, answer)
        with self._lock:
            self._waiting.append(asked)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            if self._stop.is_set():
                break
            with self._lock:
                waiting, self._waiting = self._waiting, []
                self._wake.clear()
            still = self._ask_all(waiting)
            with self._lock:
                self._waiting[:0] = still
                if self._waiting:
                    self._wake.set()
            self._stop.wait(QUERY_INTERVAL_S)
        with self._lock:  # closing: whoever still waits hears why
            waiting, self._waiting = self._waiting, []
        for asked in waiting:
            self._tell(asked, None, "this decode rank is closing")

    def _ask_all(self, waiting: list[_Asked]) -> list[_Asked]:
        """Every waiting room asked (in bodies of `MAX_ROOMS_PER_QUERY`), per service; what is
        still unanswered and within its deadline."""
        by_address: dict[tuple[str, int], list[_Asked]] = {}
        for asked in waiting:
            by_address.setdefault((asked.address, asked.dp_size), []).append(asked)
        still = []
        for (address, dp_size), group in by_address.items():
            rooms = sorted({asked.room for asked in group})
            found: dict[int, int | str] = {}
            problem = None
            for start in range(0, len(rooms), MAX_ROOMS_PER_QUERY):
                if self._stop.is_set():
                    return waiting
                try:
                    found.update(
                        query_dp_ranks(address, rooms[start : start + MAX_ROOMS_PER_QUERY], dp_size)
                    )
                except Exception as exc:  # no answer, or a broken one: asked again
                    problem = f"{type(exc).__name__}: {exc}"[:200]
            now = time.monotonic()
            for asked in group:
                rank = found.get(asked.room)
                if isinstance(rank, int):
                    self._tell(asked, rank, None)
                elif isinstance(rank, str):
                    self._tell(asked, None, f"the SGLang prefill group at {address} {rank}")
                elif now >= asked.deadline:
                    reason = (
                        f"the SGLang prefill group at {address} named no DP rank for room "
                        f"{asked.room} within {self._timeout_s:g} s "
                        f"({problem or asked.last_problem})"
                    )
                    self._tell(asked, None, reason)
                else:
                    asked.last_problem = problem or asked.last_problem
                    still.append(asked)
        return still

    @staticmethod
    def _tell(asked: _Asked, rank: int | None, reason: str | None) -> None:
        try:
            asked.answer(rank, reason)
        except Exception:
            log.exception("room %d: taking its prefill DP rank failed", asked.room)

    def close(self) -> None:
        """Stop asking; every room still waiting is answered None (the rank is closing)."""
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=QUERY_TIMEOUT_S + 1.0)
