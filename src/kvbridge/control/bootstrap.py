"""Rendezvous: the bootstrap HTTP service and its client.

Prefill ranks register their control endpoint and the group's topology; decode ranks look the
group up. Until every rank of the prefill group has registered, lookups and `/health` answer
503; a registration that conflicts with what is recorded is refused with 409, never silently
overwritten. The service runs inside prefill rank 0 or standalone (`kvbridge bootstrap`).

    PUT /prefill   {"rank", "attn_tp_size", "host", "port", "engine"}   → 200 | 400 | 401 | 409
                   (with a shared secret: header "Authorization: Bearer <bootstrap_token>")
    GET /prefill   → 200 {"attn_tp_size", "ranks": [...]} | 503 {"registered", "expected"}
    GET /health    → 200 when the group is complete, else 503
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 64 * 1024

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

    @staticmethod
    def parse(document: Any) -> PrefillRank:
        """From JSON, refusing anything that is not exactly the expected fields and types."""
        if not isinstance(document, dict):
            raise ValueError("expected a JSON object")
        types = {"rank": int, "attn_tp_size": int, "host": str, "port": int, "engine": str}
        if set(document) != set(types):
            raise ValueError(f"expected the fields {sorted(types)}, got {sorted(document)}")
        for name, kind in types.items():
            value = document[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
        rank = PrefillRank(**document)
        if rank.attn_tp_size < 1 or not 0 <= rank.rank < rank.attn_tp_size:
            raise ValueError(f"rank {rank.rank} is outside attn_tp_size {rank.attn_tp_size}")
        if not 0 < rank.port < 65536:
            raise ValueError(f"port {rank.port} is not a TCP port")
        return rank


class PrefillGroup:
    """The registry behind the service: pure bookkeeping, one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, PrefillRank] = {}

    def register(self, rank: PrefillRank) -> str | None:
        """Record a rank; the conflict that refuses it, or None."""
        with self._lock:
            sizes = {known.attn_tp_size for known in self._ranks.values()}
            if sizes and rank.attn_tp_size not in sizes:
                return (
                    f"the group was registered with attn_tp_size {sizes.pop()}, this rank says "
                    f"{rank.attn_tp_size}"
                )
            known = self._ranks.get(rank.rank)
            if known is not None and known != rank:
                return f"rank {rank.rank} is already registered as {asdict(known)}"
            self._ranks[rank.rank] = rank
            return None

    def snapshot(self) -> tuple[bool, dict[str, Any]]:
        """(complete, document) for lookups."""
        with self._lock:
            if not self._ranks:
                return False, {"registered": 0, "expected": None}
            size = next(iter(self._ranks.values())).attn_tp_size
            if len(self._ranks) < size:
                return False, {"registered": len(self._ranks), "expected": size}
            ranks = [asdict(self._ranks[index]) for index in range(size)]
            return True, {"attn_tp_size": size, "ranks": ranks}


class _Handler(BaseHTTPRequestHandler):
    server: _BootstrapHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        # The standard library writes each request to stderr; route it to the logger, at
        # DEBUG (quiet unless asked for).
        log.debug("%s %s", self.client_address[0], format % args)

    def _reply(self, status: HTTPStatus, document: dict[str, Any]) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        complete, document = self.server.group.snapshot()
        if self.path == "/health":
            status = HTTPStatus.OK if complete else HTTPStatus.SERVICE_UNAVAILABLE
            self._reply(status, {"status": "ready" if complete else "waiting", **document})
        elif self.path == "/prefill":
            self._reply(HTTPStatus.OK if complete else HTTPStatus.SERVICE_UNAVAILABLE, document)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})

    def do_PUT(self) -> None:
        if self.path != "/prefill":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
            return
        token = self.server.token
        offered = self.headers.get("Authorization", "")
        if token is not None and not hmac.compare_digest(offered, f"Bearer {token}"):
            self.server.unauthorized += 1
            log.warning("refused a registration from %s without the token", self.client_address[0])
            self._reply(HTTPStatus.UNAUTHORIZED, {"error": "registration needs the token"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError(f"body of {length} bytes (1 to {MAX_BODY} accepted)")
            rank = PrefillRank.parse(json.loads(self.rfile.read(length)))
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("refused a malformed registration from %s: %s", self.client_address[0], exc)
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        conflict = self.server.group.register(rank)
        if conflict is not None:
            log.warning("refused prefill rank %d: %s", rank.rank, conflict)
            self._reply(HTTPStatus.CONFLICT, {"error": conflict})
        else:
            log.info("prefill rank %d of %d registered at %s:%d", rank.rank, rank.attn_tp_size,
                     rank.host, rank.port)  # fmt: skip
            self._reply(HTTPStatus.OK, {"registered": asdict(rank)})


class _BootstrapHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    group: PrefillGroup
    token: str | None
    unauthorized: int = 0


def bootstrap_token(secret: bytes) -> str:
    """The bearer token bootstrap writes need: derived from the shared secret, never it."""
    return hmac.new(secret, b"kvbridge bootstrap v1", hashlib.sha256).hexdigest()


class BootstrapServer:
    """The service on (host, port); port 0 picks a free one. Runs on a daemon thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: bytes | None = None) -> None:
        self._server = _BootstrapHTTPServer((host, port), _Handler)
        self._server.group = PrefillGroup()
        self._server.token = bootstrap_token(secret) if secret else None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvbridge-bootstrap", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> BootstrapServer:
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


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
    url: str, rank: PrefillRank, timeout_s: float = 30.0, secret: bytes | None = None
) -> None:
    """Register a prefill rank, retrying while the service is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, document = _request(
                f"{url}/prefill", "PUT", asdict(rank), timeout_s=5.0, secret=secret
            )
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                raise BootstrapError(
                    f"bootstrap {url} unreachable for {timeout_s:g} s: {exc}"
                ) from None
            time.sleep(0.05)
            continue
        if status == HTTPStatus.OK:
            return
        raise BootstrapError(
            f"bootstrap {url} refused rank {rank.rank} ({status}): {document.get('error')}"
        )


def lookup_prefill_group(url: str, timeout_s: float = 30.0) -> list[PrefillRank]:
    """The prefill group's ranks, waiting until every one has registered."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, document = _request(f"{url}/prefill", "GET", None, timeout_s=5.0)
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        else:
            if status == HTTPStatus.OK:
                return [PrefillRank.parse(entry) for entry in document["ranks"]]
            last = f"{status}: {document}"
        time.sleep(0.05)
    raise BootstrapError(f"prefill group at {url} not complete after {timeout_s:g} s ({last})")
