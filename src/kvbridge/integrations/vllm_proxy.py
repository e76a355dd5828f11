"""A small PD proxy for vLLM instances (`kvbridge vllm-proxy`): each OpenAI completion or
chat request goes to a prefill instance with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true}``, then to a decode instance with the ``kv_transfer_params`` of
prefill's answer; decode's answer (streamed or not) goes back to the client. Instances are
taken in turn. It works with any connector that follows vLLM's PD flow (kvbridge's, vLLM's
NixlConnector). Standard library only: it runs in any environment.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from kvbridge.integrations.vllm_core import OptionsError
from kvbridge.integrations.vllm_requests import decode_request, prefill_request

log = logging.getLogger("kvbridge.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
UPSTREAM_TIMEOUT_S = 600.0


class UpstreamError(Exception):
    """An instance that could not be reached or refused the request."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _connection(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url!r} is not an http://host:port URL")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=UPSTREAM_TIMEOUT_S)


def _post(url: str, path: str, body: dict[str, Any],
          headers: dict[str, str]) -> http.client.HTTPResponse:  # fmt: skip
    connection = _connection(url)
    try:
        connection.request(
            "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
        )
        return connection.getresponse()
    except OSError as exc:
        connection.close()
        raise UpstreamError(502, f"{url} unreachable: {exc}") from None


class PDProxy:
    """Round-robin over prefill and decode instances; `serve_forever` until `shutdown`."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a PD proxy needs at least one prefill and one decode instance")
        for url in (*prefill, *decode):
            _connection(url).close()  # refuses a malformed URL at start-up
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._turn = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                proxy._handle_post(self)

            def do_GET(self) -> None:
                proxy._handle_get(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def serve_forever(self) -> None:
        self.server.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next(self, instances: Iterator[str]) -> str:
        with self._turn:
            return next(instances)

    def _handle_get(self, handler: BaseHTTPRequestHandler) -> None:
        if handler.path == "/health":
            _answer(handler, 200, {"status": "ok"})
            return
        if handler.path != "/v1/models":
            _answer(handler, 404, {"error": f"no route {handler.path}"})
            return
        connection = _connection(self._next(self._decode))
        try:
            connection.request("GET", handler.path)
            _relay(handler, connection.getresponse())
        except OSError as exc:
            _answer(handler, 502, {"error": f"decode unreachable: {exc}"})
        finally:
            connection.close()

    def _handle_post(self, handler: BaseHTTPRequestHandler) -> None:
        if handler.path not in ROUTES:
            _answer(handler, 404, {"error": f"no route {handler.path}; try {', '.join(ROUTES)}"})
            return
        try:
            length = int(handler.headers.get("Content-Length", "0"))
            body = json.loads(handler.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
        except ValueError as exc:
            _answer(handler, 400, {"error": f"bad request body: {exc}"})
            return
        prefill, decode = self._next(self._prefill), self._next(self._decode)
        headers = _forwarded(handler)
        try:
            answer = _post(prefill, handler.path, prefill_request(body), headers)
            prefilled = answer.read()
            if answer.status != 200:
                raise UpstreamError(answer.status, f"prefill {prefill}: {prefilled[:2000]!r}")
            forward = decode_request(body, json.loads(prefilled))
            response = _post(decode, handler.path, forward, headers)
        except (UpstreamError, OptionsError, ValueError) as exc:
            status = exc.status if isinstance(exc, UpstreamError) else 502
            log.warning("request failed: %s", exc)
            _answer(handler, status, {"error": str(exc)})
            return
        try:
            _relay(handler, response)
        finally:
            response.close()


def _forwarded(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    """The headers both instances get: the client's credentials (servers started with
    --api-key want them) and one request id, the client's or a new one (vLLM names the
    request by it on both sides, as NixlPushConnector needs to pair them)."""
    headers = {"X-Request-Id": handler.headers.get("X-Request-Id") or uuid.uuid4().hex}
    if (credentials := handler.headers.get("Authorization")) is not None:
        headers["Authorization"] = credentials
    return headers


def _answer(handler: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _relay(handler: BaseHTTPRequestHandler, response: http.client.HTTPResponse) -> None:
    """Decode's answer to the client: whole, or chunk by chunk as it streams."""
    handler.send_response(response.status)
    handler.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
    length = response.getheader("Content-Length")
    if length is not None:
        data = response.read()
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
        return
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    while chunk := response.read1(65536):
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        handler.wfile.flush()
    handler.wfile.write(b"0\r\n\r\n")
