"""Rendezvous: the bootstrap HTTP service and its client.

Prefill ranks register their control endpoint and the group's topology; decode ranks look the
group up. Until every rank of the prefill group has registered, lookups and `/health` answer
503; a registration that conflicts with a live one is refused with 409, never silently
overwritten. Registrations are leases: a prefill rank renews its own every third of
`lease_s` and withdraws it at close; one not renewed for `lease_s` expires, so a restarted
rank (or the real one, after a bogus first registration) gets in. The service runs inside
prefill rank 0 or standalone (`kvbridge bootstrap`).

    PUT    /prefill  {"rank", "attn_tp_size", "host", "port", "engine"} → 200 {"lease_s"}
                     | 400 | 401 | 409 | 413 | 429
    DELETE /prefill  (the same body: only an identical registration is withdrawn) → 200 | 404
    GET    /prefill  → 200 {"attn_tp_size", "ranks": [...]} | 503 {"registered", "expected"}
    GET    /health   → 200 when the group is complete, else 503

With a shared secret every route needs the header "Authorization: Bearer <bootstrap_token>"
(401 otherwise; a client that keeps offering wrong tokens gets 429 for a while).

The HTTP shell serves every connection on one asyncio loop (no thread per client): a client
has `CLIENT_TIMEOUT_S` to send its whole request, and a connection beyond `MAX_CONNECTIONS`
open at once is closed at once. What is answered is decided by the pure `BootstrapService`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

from kvbridge.wire.address import host_problem
from kvbridge.wire.native import VERSION

MAX_BODY = 4 * 1024  # a registration is ~100 bytes
# sglang's decode asks for every pending room's DP rank in one body (`/query_dp_ranks`): up
# to ~10k rooms of 20 digits. Only that route takes such a body.
MAX_QUERY_BODY = 256 * 1024
LARGE_BODY_ROUTES = ("/query_dp_ranks",)
MAX_ATTN_TP = 4096
MAX_ENGINE_NAME = 64
LEASE_S = 10.0
MAX_CONNECTIONS = 1024  # open at once; more are closed at once
LISTEN_BACKLOG = 1024
MAX_HEADER_BYTES = 16 * 1024
CLIENT_TIMEOUT_S = 5.0  # to send the whole request
# Wrong tokens from one address before it is refused for `AUTH_PENALTY_S` (429).
MAX_AUTH_FAILURES = 20
AUTH_PENALTY_S = 60.0

log = logging.getLogger("kvbridge.bootstrap")


class BootstrapError(RuntimeError):
    """Rendezvous failed: the service refused, or did not answer before the deadline."""


@dataclass(frozen=True)
class PrefillRank:
    """One prefill rank as decode ranks find it."""

    rank: int
    attn_tp_size: int
    host: str
    port: int
    engine: str
    version: str = VERSION  # the protocol version the rank speaks

    @staticmethod
    def parse(document: Any) -> PrefillRank:
        """From JSON, refusing anything that is not exactly the expected fields and types."""
        if not isinstance(document, dict):
            raise ValueError("expected a JSON object")
        types = {
            "rank": int,
            "attn_tp_size": int,
            "host": str,
            "port": int,
            "engine": str,
            "version": str,
        }
        if set(document) == set(types) - {"version"}:
            raise ValueError(
                f"the prefill rank names no protocol version: it runs a kvbridge older than "
                f"{VERSION}, which this side speaks; run one kvbridge release on both sides"
            )
        if set(document) != set(types):
            raise ValueError(f"expected the fields {sorted(types)}, got {sorted(document)}")
        for name, kind in types.items():
            value = document[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
        rank = PrefillRank(**document)
        problem = host_problem(rank.host)
        if problem is not None:
            raise ValueError(f"host: {problem}")
        if not 0 < len(rank.engine) <= MAX_ENGINE_NAME or not rank.engine.isidentifier():
            raise ValueError(f"engine must be a short name like nixl, got {rank.engine[:80]!r}")
        if not 1 <= rank.attn_tp_size <= MAX_ATTN_TP:
            raise ValueError(f"attn_tp_size {rank.attn_tp_size} is not in 1..{MAX_ATTN_TP}")
        if not 0 <= rank.rank < rank.attn_tp_size:
            raise ValueError(f"rank {rank.rank} is outside attn_tp_size {rank.attn_tp_size}")
        if not 0 < rank.port < 65536:
            raise ValueError(f"port {rank.port} is not a TCP port")
        if not 0 < len(rank.version) <= MAX_ENGINE_NAME:
            raise ValueError(f"version must be like {VERSION}, got {rank.version[:80]!r}")
        return rank

    @property
    def version_problem(self) -> str | None:
        """Why this side cannot work with the rank (another protocol version), or None."""
        if self.version == VERSION:
            return None
        return (
            f"prefill rank {self.rank} speaks {self.version}, this side {VERSION}: run one "
            "kvbridge release on both sides"
        )


class PrefillGroup:
    """The registry behind the service: pure bookkeeping (time passed in), one lock. Each
    registration is a lease that its rank renews; an expired one is forgotten."""

    def __init__(self, lease_s: float = LEASE_S) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._ranks: dict[int, tuple[PrefillRank, float]] = {}  # rank → (entry, expires at)

    def _expire_locked(self, now: float) -> None:
        for index in [index for index, (_, until) in self._ranks.items() if until <= now]:
            log.info("prefill rank %d's registration expired", index)
            del self._ranks[index]

    def register(self, rank: PrefillRank, now: float) -> str | None:
        """Record or renew a rank; the conflict that refuses it, or None."""
        with self._lock:
            self._expire_locked(now)
            sizes = {known.attn_tp_size for known, _ in self._ranks.values()}
            if sizes and rank.attn_tp_size not in sizes:
                return (
                    f"the group was registered with attn_tp_size {sizes.pop()}, this rank says "
                    f"{rank.attn_tp_size}"
                )
            known = self._ranks.get(rank.rank)
            if known is not None and known[0] != rank:
                return (
                    f"rank {rank.rank} is already registered as {asdict(known[0])} (its lease "
                    f"runs out in {known[1] - now:.1f} s unless renewed)"
                )
            if known is None:
                log.info(
                    "prefill rank %d of %d registered at %s:%d",
                    rank.rank,
                    rank.attn_tp_size,
                    rank.host,
                    rank.port,
                )
            self._ranks[rank.rank] = (rank, now + self.lease_s)
            return None

    def withdraw(self, rank: PrefillRank, now: float) -> bool:
        """Forget a rank's registration, only if it is exactly this one."""
        with self._lock:
            self._expire_locked(now)
            known = self._ranks.get(rank.rank)
            if known is None or known[0] != rank:
                return False
            del self._ranks[rank.rank]
            return True

    def snapshot(self, now: float) -> tuple[bool, dict[str, Any]]:
        """(complete, document) for lookups."""
        with self._lock:
            self._expire_locked(now)
            if not self._ranks:
                return False, {"registered": 0, "expected": None}
            size = next(iter(self._ranks.values()))[0].attn_tp_size
            if len(self._ranks) < size:
                return False, {"registered": len(self._ranks), "expected": size}
            ranks = [asdict(self._ranks[index][0]) for index in range(size)]
            return True, {"attn_tp_size": size, "ranks": ranks}


def bootstrap_token(secret: bytes) -> str:
    """The bearer token bootstrap writes need: derived from the shared secret, never it."""
    return hmac.new(secret, b"kvbridge bootstrap v1", hashlib.sha256).hexdigest()


@dataclass
class Reply:
    status: HTTPStatus
    document: dict[str, Any]


class BootstrapService:
    """What the service answers, pure: a request in (method, path, headers, body, client
    address, time), a reply out. The HTTP shell below only reads and writes sockets."""

    def __init__(self, secret: bytes | None = None, lease_s: float = LEASE_S) -> None:
        self.group = PrefillGroup(lease_s)
        self.token = bootstrap_token(secret) if secret else None
        self.unauthorized = 0
        self._auth_failures: dict[str, list[float]] = {}

    def _refusal(self, headers: dict[str, str], client: str, now: float) -> Reply | None:
        """With a secret: 401 without the token, 429 after too many wrong ones lately."""
        if self.token is None:
            return None
        recent = [t for t in self._auth_failures.pop(client, []) if now - t < AUTH_PENALTY_S]
        if len(recent) >= MAX_AUTH_FAILURES:
            self._auth_failures[client] = recent
            return Reply(HTTPStatus.TOO_MANY_REQUESTS, {"error": "too many wrong tokens"})
        offered = headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(offered, f"Bearer {self.token}".encode()):
            if recent:
                self._auth_failures[client] = recent
            return None
        self.unauthorized += 1
        if len(self._auth_failures) < 4096:  # bounded under a storm of addresses
            self._auth_failures[client] = [*recent, now]
        # One warning per client and penalty window, not one per request of a storm.
        (log.debug if recent else log.warning)(
            "refused a request from %s without the token", client
        )
        return Reply(HTTPStatus.UNAUTHORIZED, {"error": "this service needs the token"})

    def handle(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        client: str,
        now: float,
    ) -> Reply:
        routes = {
            ("GET", "/health"),
            ("GET", "/prefill"),
            ("PUT", "/prefill"),
            ("DELETE", "/prefill"),
        }
        if (method, path) not in routes:
            known = {route for _, route in routes}
            status = HTTPStatus.METHOD_NOT_ALLOWED if path in known else HTTPStatus.NOT_FOUND
            return Reply(status, {"error": f"no route {method} {path[:100]}"})
        refusal = self._refusal(headers, client, now)
        if refusal is not None:
            return refusal
        if method == "GET":
            complete, document = self.group.snapshot(now)
            status = HTTPStatus.OK if complete else HTTPStatus.SERVICE_UNAVAILABLE
            if path == "/health":
                document = {"status": "ready" if complete else "waiting", **document}
            return Reply(status, document)
        try:
            rank = PrefillRank.parse(json.loads(body))
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            reason = "JSON nested too deep" if isinstance(exc, RecursionError) else str(exc)
            log.warning("refused a malformed registration from %s: %s", client, reason)
            return Reply(HTTPStatus.BAD_REQUEST, {"error": reason})
        if method == "DELETE":
            if not self.group.withdraw(rank, now):
                return Reply(HTTPStatus.NOT_FOUND, {"error": "no such registration"})
            log.info("prefill rank %d withdrew its registration", rank.rank)
            return Reply(HTTPStatus.OK, {"withdrawn": asdict(rank)})
        if rank.version_problem is not None:  # not a conflict to wait out: refused at once
            log.warning("refused prefill rank %d: %s", rank.rank, rank.version_problem)
            return Reply(HTTPStatus.BAD_REQUEST, {"error": rank.version_problem})
        conflict = self.group.register(rank, now)
        if conflict is not None:
            log.warning("refused prefill rank %d: %s", rank.rank, conflict)
            return Reply(HTTPStatus.CONFLICT, {"error": conflict})
        return Reply(HTTPStatus.OK, {"registered": asdict(rank), "lease_s": self.group.lease_s})


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes]:
    """One HTTP/1.1 request: (method, path, lower-cased headers, body)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too large") from None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "not an HTTP request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = b""
    if parts[0] in ("PUT", "POST", "DELETE"):
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            length = -1
        largest = MAX_QUERY_BODY if parts[1].partition("?")[0] in LARGE_BODY_ROUTES else MAX_BODY
        if length > largest:
            raise _BadRequest(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {length} bytes (1 to {largest} accepted)",
            )
        if length < 1:
            raise _BadRequest(
                HTTPStatus.BAD_REQUEST, f"body of {length} bytes (1 to {largest} accepted)"
            )
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            reason = f"body ended after {len(exc.partial)} of {length} bytes"
            raise _BadRequest(HTTPStatus.BAD_REQUEST, reason) from None
    return parts[0], parts[1], headers, body


class BootstrapServer:
    """The service on (host, port); port 0 picks a free one. One event loop serves every
    connection (no thread per client); a client has `CLIENT_TIMEOUT_S` to send its request,
    at most `MAX_CONNECTIONS` are open at once (more are closed at once). `start()` runs it on
    a daemon thread, `serve_forever()` on the calling one."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        lease_s: float = LEASE_S,
        service: BootstrapService | None = None,
    ) -> None:
        # `service`: what it answers, if not kvbridge's own routes (`sglang_routes`).
        self.service = service if service is not None else BootstrapService(secret, lease_s)
        self.refused_connections = 0
        self._connections = 0
        self._loop = asyncio.new_event_loop()
        self._listener = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self._server: asyncio.Server | None = None
        self._stopped = asyncio.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host!s}:{port}"

    @property
    def unauthorized(self) -> int:
        return self.service.unauthorized

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= MAX_CONNECTIONS:
            self.refused_connections += 1
            writer.close()
            return
        self._connections += 1
        client = str(writer.get_extra_info("peername", ("?",))[0])
        try:
            try:
                method, path, headers, body = await asyncio.wait_for(
                    _read_request(reader), CLIENT_TIMEOUT_S
                )
                reply = self.service.handle(method, path, headers, body, client, time.monotonic())
                log.debug("%s %s %s: %d", client, method, path[:100], reply.status)
            except _BadRequest as exc:
                reply = Reply(exc.status, {"error": str(exc)})
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return  # a slow, vanished or half-open client: dropped
            payload = json.dumps(reply.document).encode()
            writer.write(
                f"HTTP/1.1 {reply.status.value} {reply.status.phrase}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + payload
            )
            await asyncio.wait_for(writer.drain(), CLIENT_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            self._connections -= 1
            writer.close()

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(
            self._client, sock=self._listener, limit=MAX_HEADER_BYTES
        )
        async with self._server:
            await self._stopped.wait()

    def start(self) -> BootstrapServer:
        self._thread = threading.Thread(
            target=self.serve_forever, name="kvbridge-bootstrap", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:  # stopped or interrupted: end every client's task before the loop closes
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)  # runs once the loop does
            self._thread.join(timeout=5.0)
        elif self._loop.is_running():  # serve_forever() on a thread of the caller's
            self._loop.call_soon_threadsafe(self._stopped.set)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        self._listener.close()


def _request(
    url: str,
    method: str,
    body: dict[str, Any] | None,
    timeout_s: float,
    secret: bytes | None = None,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if secret:
        request.add_header("Authorization", f"Bearer {bootstrap_token(secret)}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def register_prefill(
    url: str,
    rank: PrefillRank,
    timeout_s: float = 30.0,
    secret: bytes | None = None,
    *,
    wait_out_conflicts: bool = False,
) -> float:
    """Register (or renew) a prefill rank, retrying while the service is not up yet; with
    `wait_out_conflicts`, also while another registration of the rank holds its lease (a
    restarted rank waits for its dead predecessor's to expire). The lease, in seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, document = _request(
                f"{url}/prefill", "PUT", asdict(rank), timeout_s=5.0, secret=secret
            )
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if time.monotonic() > deadline:
                raise BootstrapError(
                    f"bootstrap {url} unreachable for {timeout_s:g} s: {exc}"
                ) from None
            time.sleep(0.05)
            continue
        if status == HTTPStatus.OK:
            return float(document.get("lease_s", LEASE_S))
        if status == HTTPStatus.CONFLICT and wait_out_conflicts and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        raise BootstrapError(
            f"bootstrap {url} refused rank {rank.rank} ({status}): {document.get('error')}"
        )


def withdraw_prefill(url: str, rank: PrefillRank, secret: bytes | None = None) -> None:
    """Withdraw a rank's registration (at close); a service that is gone is no error."""
    try:
        _request(f"{url}/prefill", "DELETE", asdict(rank), timeout_s=2.0, secret=secret)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.debug("could not withdraw rank %d from %s: %s", rank.rank, url, exc)


class LeaseRenewer:
    """Renews a prefill rank's registration every third of its lease, on its own thread,
    until closed (then withdraws it)."""

    def __init__(self, url: str, rank: PrefillRank, lease_s: float, secret: bytes | None) -> None:
        self._url, self._rank, self._secret = url, rank, secret
        self._interval_s = max(0.05, lease_s / 3)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvbridge-bootstrap-lease", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                lease_s = register_prefill(
                    self._url, self._rank, timeout_s=self._interval_s, secret=self._secret
                )
                self._interval_s = max(0.05, lease_s / 3)
            except BootstrapError as exc:
                log.warning(
                    "could not renew prefill rank %d's registration: %s", self._rank.rank, exc
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        withdraw_prefill(self._url, self._rank, self._secret)


def lookup_prefill_group(
    url: str, timeout_s: float = 30.0, secret: bytes | None = None
) -> list[PrefillRank]:
    """The prefill group's ranks, waiting until every one has registered."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, document = _request(f"{url}/prefill", "GET", None, 5.0, secret)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = str(exc)
        else:
            if status == HTTPStatus.OK:
                try:
                    ranks = [PrefillRank.parse(entry) for entry in document["ranks"]]
                except (KeyError, TypeError, ValueError) as exc:
                    raise BootstrapError(f"bootstrap {url} sent a bad group: {exc}") from None
                problem = next((r.version_problem for r in ranks if r.version_problem), None)
                if problem is not None:
                    raise BootstrapError(f"bootstrap {url}: {problem}")
                return ranks
            if status in (HTTPStatus.UNAUTHORIZED, HTTPStatus.TOO_MANY_REQUESTS):
                raise BootstrapError(
                    f"bootstrap {url} refused the lookup ({status}): {document.get('error')}"
                )
            last = f"{status}: {document}"
        time.sleep(0.05)
    raise BootstrapError(f"prefill group at {url} not complete after {timeout_s:g} s ({last})")
