"""The PD proxy's side toward the instances (`kvbridge vllm-proxy`): one pooled aiohttp
session, each failure named by instance and role, decode's answer relayed to the client
whole or as it streams, and the proxy's own time per request apart from its waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvbridge.proxy")
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
JSON_BODY = {"Content-Type": "application/json"}
# The client's headers both instances get (credentials: servers started with --api-key want
# them); the request id is always set, the client's or a new one.
FORWARDED_HEADERS = ("Authorization",)
REQUEST_ID = "X-Request-Id"


class UpstreamError(Exception):
    """An instance that could not be reached or refused the request."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OwnTime:
    """A request's time in the proxy less its waits on the instances: in all, and until the
    client's first byte was handed to the socket."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.waited = 0.0
        self.own_before_first_byte: float | None = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        asked = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - asked

    def first_byte(self) -> None:
        if self.own_before_first_byte is None:
            self.own_before_first_byte = self.own()

    def own(self) -> float:
        return time.perf_counter() - self.began - self.waited


class Upstream:
    """Requests to the instances over one session; `timeout_s` is how long an instance may
    go without sending a byte (then its request ends with 504, the instance named)."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self.session = session
        self.timeout_s = timeout_s

    async def send(
        self, url: str, path: str, body: bytes, headers: dict[str, str], role: str
    ) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(url + path, data=body, headers={**headers, **JSON_BODY})
        except UPSTREAM_ERRORS as exc:
            raise self.failure(role, url, exc, "failed") from None

    def failure(self, role: str, url: str, exc: BaseException, doing: str) -> UpstreamError:
        """An upstream exception as the client's error, the instance named: 502 for one that
        cannot be reached or broke off, 504 for one that sent nothing within the timeout."""
        if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
            return UpstreamError(502, f"{role} {url} unreachable: {_reason(exc)}")
        # asyncio's, which aiohttp's read timeouts derive from (the builtin from 3.11 only).
        if isinstance(exc, asyncio.TimeoutError):
            return UpstreamError(504, f"{role} {url} sent nothing for {self.timeout_s:g} s")
        return UpstreamError(502, f"{role} {url} {doing}: {_reason(exc)}")

    async def prefill_answer(
        self, url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> bytes:
        async with await self.send(url, path, body, headers, "prefill") as got:
            try:
                data = await got.read()
            except UPSTREAM_ERRORS as exc:
                raise self.failure("prefill", url, exc, "answered in part") from None
            if got.status != 200:
                raise UpstreamError(got.status, f"prefill {url}: {data[:2000]!r}")
        return data

    async def relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        url: str,
        clock: OwnTime | None = None,
    ) -> web.StreamResponse:
        """Decode's answer (from `url`) to the client, whole or chunk by chunk as it streams
        (the waits for it on `clock`). A streamed answer cut off upstream cuts the client's
        connection: its status is already sent."""
        clock = clock or OwnTime()
        async with upstream:
            content_type = upstream.headers.get("Content-Type", "application/json")
            if upstream.headers.get("Content-Length") is not None:
                try:
                    with clock.waiting():
                        data = await upstream.read()
                except UPSTREAM_ERRORS as exc:
                    raise self.failure("decode", url, exc, "answered in part") from None
                return web.Response(
                    status=upstream.status, body=data, headers={"Content-Type": content_type}
                )
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": content_type}
            )
            response.enable_chunked_encoding()
            await response.prepare(request)
            chunks = upstream.content.iter_any()
            while True:
                try:
                    with clock.waiting():
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except UPSTREAM_ERRORS as exc:
                    # The instance went away mid-answer: the client's connection is cut, so
                    # that it sees an error rather than a short answer that looks whole.
                    log.warning("answer from upstream ended early: %r", exc)
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                try:
                    await response.write(chunk)
                except ConnectionError:  # the client went away: nobody to answer
                    return response
                clock.first_byte()
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response


def json_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def answer_object(url: str, data: bytes) -> dict[str, Any]:
    """Prefill's answer as a JSON object, or the client's error naming the instance."""
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise UpstreamError(502, f"prefill {url} answered no JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise UpstreamError(502, f"prefill {url} answered no JSON object")
    return answer


def _reason(exc: BaseException) -> str:
    """An upstream error for the client, without aiohttp's connection-key repr."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The headers both instances get: the client's credentials and one request id (vLLM
    names the request by it on both sides, as NixlPushConnector needs to pair them)."""
    headers = {REQUEST_ID: request.headers.get(REQUEST_ID) or uuid.uuid4().hex}
    for name in FORWARDED_HEADERS:
        if (value := request.headers.get(name)) is not None:
            headers[name] = value
    return headers
