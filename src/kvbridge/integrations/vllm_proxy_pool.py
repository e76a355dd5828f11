"""The PD proxy's choice of instance (`kvbridge vllm-proxy`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvbridge.integrations.vllm_options import rank_bootstrap_port


class Pool:
    """Instances of one role: each request goes to the one with the fewest requests in flight
    through this proxy (a slow instance gets less), among equals the one used longest ago
    with the same partner (the prefill instance a decode instance would load from), so that
    every prefill-decode pairing occurs."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._order = itertools.count()
        self._last_used: dict[tuple[str, str], int] = {}  # (partner, url) → when

    @contextlib.contextmanager
    def take(self, partner: str = "") -> Iterator[str]:
        url = min(
            self.urls, key=lambda u: (self._in_flight[u], self._last_used.get((partner, u), -1))
        )
        self._in_flight[url] += 1
        self._last_used[partner, url] = next(self._order)
        try:
            yield url
        finally:
            self._in_flight[url] -= 1


# vLLM's header that sends a request to one data-parallel rank of an instance.
DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class PrefillTarget:
    """Where a request's prefill goes: an instance, and for decode first the kvbridge
    bootstrap service decode asks there; with data parallelism one rank of the instance (it
    gets the request by `DP_RANK_HEADER`, and serves its own bootstrap service)."""

    url: str
    bootstrap: str = ""
    dp_rank: int | None = None

    @property
    def name(self) -> str:
        return self.url if self.dp_rank is None else f"{self.url} (DP rank {self.dp_rank})"

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.dp_rank is None else {DP_RANK_HEADER: str(self.dp_rank)}


def prefill_targets(
    urls: Sequence[str], bootstraps: Sequence[str], dp_size: int = 1
) -> dict[str, PrefillTarget]:
    """The proxy's prefill targets by name: each instance, or with decode first and `dp_size`
    data-parallel ranks per instance each rank (its bootstrap service at the instance's
    bootstrap port + its index, `rank_bootstrap_port`)."""
    if dp_size < 1:
        raise ValueError(f"prefill data-parallel size {dp_size}: give 1 or more")
    if bootstraps and len(bootstraps) != len(urls):
        raise ValueError(
            f"decode first needs each prefill instance's bootstrap service: "
            f"{len(urls)} prefill instance(s), {len(bootstraps)} bootstrap URL(s)"
        )
    if dp_size > 1 and not bootstraps:
        raise ValueError(
            "a prefill data-parallel size is for decode first (with the prefill instances' "
            "bootstrap services): otherwise prefill's answer names the rank that served it"
        )
    if not bootstraps:
        return {url: PrefillTarget(url) for url in urls}
    targets = [
        PrefillTarget(url, bootstrap)
        if dp_size == 1
        else PrefillTarget(url, _at_port(bootstrap, rank_bootstrap_port(_port(bootstrap), r)), r)
        for url, bootstrap in zip(urls, bootstraps, strict=True)
        for r in range(dp_size)
    ]
    return {target.name: target for target in targets}


def _port(url: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{url}: a bootstrap service URL names its port")
    return port


def _at_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return parts._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}").geturl()
