"""A PD proxy for vLLM instances (`kvbridge vllm-proxy`): each OpenAI completion or chat
request goes to a prefill instance with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true}``, then to a decode instance with the ``kv_transfer_params`` of
prefill's answer; decode's answer (streamed or not) goes back to the client as it comes.
Each request goes to the instances with the fewest requests in flight. It works with any
connector that follows vLLM's PD flow (kvbridge's, vLLM's NixlConnector).

Decode first (kvbridge's connector; `prefill_bootstrap` names each prefill instance's
bootstrap service): the request goes to both at once, into a room the proxy picks; decode
allocates its blocks and asks prefill for them while prefill computes, and prefill writes
each layer as its forward computes it. Decode's answer goes back as it comes.

Built on aiohttp (vLLM's own environment has it): one event loop serves every client, and
upstream connections are pooled and kept alive, so a request costs the proxy a fraction of a
millisecond rather than a thread and two new TCP connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.integrations.vllm_proxy_pool import Pool, prefill_targets
from kvbridge.integrations.vllm_proxy_upstream import (
    UPSTREAM_ERRORS,
    OwnTime,
    Upstream,
    UpstreamError,
    answer_object,
    forwarded_headers,
    json_body,
)
from kvbridge.integrations.vllm_requests import (
    decode_first_request,
    decode_request,
    prefill_request,
    stream_prefill_request,
)

log = logging.getLogger("kvbridge.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
# The longest an instance may go without sending a byte (a hung instance's requests end
# with 504 then); connecting takes at most CONNECT_TIMEOUT_S of it.
UPSTREAM_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 30.0
KEEPALIVE_S = 4.0
SHUTDOWN_S = 5.0  # how long a shutdown lets answers in flight finish
MAX_TIMINGS = 100_000


def _check_url(url: str, port: bool = False) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or (port and parts.port is None):
        raise ValueError(f"{url!r} is not an http://host:port URL")
    return url.rstrip("/")


class PDProxy:
    """A PD proxy over prefill and decode instances (`Pool`: fewest in flight first);
    `serve_forever` (in any thread) until `shutdown`. The listening socket is bound at
    construction, so `url` is known at once. `upstream_timeout_s`: how long an instance may
    go without sending a byte before its request ends with 504, the instance named."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        upstream_timeout_s: float = UPSTREAM_TIMEOUT_S,
        prefill_bootstrap: Sequence[str] = (),
        prefill_dp_size: int = 1,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a PD proxy needs at least one prefill and one decode instance")
        # Decode first: each prefill instance's bootstrap service (or, with data parallelism,
        # each rank's), by target name.
        self._targets = prefill_targets(
            [_check_url(url) for url in prefill],
            [_check_url(bootstrap, port=True) for bootstrap in prefill_bootstrap],
            prefill_dp_size,
        )
        self._decode_first = bool(prefill_bootstrap)
        if not upstream_timeout_s > 0:
            raise ValueError(f"upstream timeout {upstream_timeout_s!r} s: give a positive time")
        self.upstream_timeout_s = upstream_timeout_s
        self._prefill = Pool(list(self._targets))
        self._decode = Pool([_check_url(url) for url in decode])
        # The proxy's own time per request (parsing, rewriting, choosing, relaying), without
        # the time spent waiting on the instances: in all, and before the client's first byte
        # (what it adds to the time to first token); the latest MAX_TIMINGS requests.
        self._own_seconds: deque[float] = deque(maxlen=MAX_TIMINGS)
        self._own_first_byte_seconds: deque[float] = deque(maxlen=MAX_TIMINGS)
        self._timings_lock = threading.Lock()  # appended on the loop, read from any thread
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(1024)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()  # serve_forever and shutdown agree on who closes
        self._shut = False
        self._done = threading.Event()  # set once the listener is closed
        self._upstream: Upstream | None = None

    def timings(self) -> tuple[list[float], list[float]]:
        """The proxy's own seconds per answered request, oldest first: in all, and before the
        client's first byte."""
        with self._timings_lock:
            return list(self._own_seconds), list(self._own_first_byte_seconds)

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._socket.close()
            self._done.set()

    def shutdown(self) -> None:
        """Stop serving (from any thread) and wait until the listener is closed."""
        with self._lock:
            self._shut = True
            loop, stop = self._loop, self._stop
        if loop is None or stop is None:  # never served
            self._socket.close()
            return
        with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
            loop.call_soon_threadsafe(stop.set)
        self._done.wait(timeout=SHUTDOWN_S + 10)

    async def _serve(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._post)
        app.router.add_post("/v1/chat/completions", self._post)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._no_route)
        # Idle upstream connections close before vLLM's server closes them (uvicorn's 5 s
        # keep-alive): a POST on a connection the server just closed is not retried.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        # No cap on a whole answer (a long stream is fine), only on each wait for bytes.
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=min(CONNECT_TIMEOUT_S, self.upstream_timeout_s),
            sock_read=self.upstream_timeout_s,
        )
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._upstream = Upstream(session, self.upstream_timeout_s)
            await runner.setup()
            try:
                await web.SockSite(runner, self._socket).start()
                await self._stop.wait()
            finally:
                await runner.cleanup()

    # --- routes ----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _no_route(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"error": f"no route {request.method} {request.path}; try {', '.join(ROUTES)}"},
            status=404,
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        decode = self._decode.urls[0]
        try:
            try:
                upstream = await self._up.session.get(decode + "/v1/models")
            except UPSTREAM_ERRORS as exc:
                raise self._up.failure("decode", decode, exc, "failed") from None
            response = await self._up.relay(request, upstream, decode)
        except UpstreamError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return response

    async def _post(self, request: web.Request) -> web.StreamResponse:
        clock = OwnTime()
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
        except ValueError as exc:
            return web.json_response({"error": f"bad request body: {exc}"}, status=400)
        headers = forwarded_headers(request)
        if self._decode_first:
            return await self._post_decode_first(request, body, headers, clock)
        try:
            # The prefill instance is held while it works, not while decode does.
            with self._prefill.take() as name:
                prefill, sent = self._targets[name].url, json_body(prefill_request(body))
                with clock.waiting():
                    data = await self._up.prefill_answer(prefill, request.path, sent, headers)
            forward = json_body(decode_request(body, answer_object(prefill, data)))
            with self._decode.take(prefill) as decode:
                with clock.waiting():
                    upstream = await self._up.send(decode, request.path, forward, headers, "decode")
                response = await self._up.relay(request, upstream, decode, clock)
        except (UpstreamError, OptionsError) as exc:
            status = exc.status if isinstance(exc, UpstreamError) else 502
            log.warning("request failed: %s", exc)
            return web.json_response({"error": str(exc)}, status=status)
        self._timed(clock)
        return response

    async def _post_decode_first(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str], clock: OwnTime
    ) -> web.StreamResponse:
        """Both instances at once, into one room: decode's answer is relayed while prefill's
        (one token) comes beside it; the prefill instance counts as busy until it answered.
        If either fails, the other's request is cut off (vLLM then aborts it): a decode
        waiting for KV that will not come, or a prefill holding KV nobody will ask for."""
        room = secrets.randbits(63)
        taken = self._prefill.take()
        prefill = self._targets[taken.__enter__()]

        async def prefill_leg() -> bytes:
            try:
                sent = json_body(stream_prefill_request(body, room))
                to_rank = {**headers, **prefill.headers}
                return await self._up.prefill_answer(prefill.url, request.path, sent, to_rank)
            finally:
                taken.__exit__(None, None, None)

        async def decode_leg() -> web.StreamResponse:
            forward = json_body(decode_first_request(body, prefill.bootstrap, room))
            with self._decode.take(prefill.name) as decode:
                with clock.waiting():
                    upstream = await self._up.send(decode, request.path, forward, headers, "decode")
                return await self._up.relay(request, upstream, decode, clock)

        prefilled = asyncio.ensure_future(prefill_leg())
        decoding = asyncio.ensure_future(decode_leg())

        def on_prefilled(task: asyncio.Future[bytes]) -> None:
            if not task.cancelled() and task.exception() is not None:
                decoding.cancel()  # it would wait for KV that will not come

        prefilled.add_done_callback(on_prefilled)
        try:
            response = await decoding
        except (UpstreamError, OptionsError) as exc:
            prefilled.cancel()  # nobody will ask for its KV
            status = exc.status if isinstance(exc, UpstreamError) else 502
            log.warning("request failed: %s", exc)
            response = web.json_response({"error": str(exc)}, status=status)
        except asyncio.CancelledError:
            failed = prefilled.done() and not prefilled.cancelled() and prefilled.exception()
            if not isinstance(failed, UpstreamError):
                prefilled.cancel()
                raise  # the client went away
            log.warning("request failed: %s", failed)
            response = web.json_response({"error": str(failed)}, status=failed.status)
        if not prefilled.cancelled():
            try:
                with clock.waiting():
                    await prefilled
            except UpstreamError as exc:
                log.warning("prefill of a decode-first request failed: %s", exc)
        self._timed(clock)
        return response

    @property
    def _up(self) -> Upstream:
        assert self._upstream is not None, "serving"
        return self._upstream

    def _timed(self, clock: OwnTime) -> None:
        own = clock.own()
        first = clock.own_before_first_byte
        with self._timings_lock:
            self._own_seconds.append(own)
            self._own_first_byte_seconds.append(own if first is None else first)  # whole: at end
