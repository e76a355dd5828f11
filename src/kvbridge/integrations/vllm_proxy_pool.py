"""The PD proxy's choice of instance (`kvbridge vllm-proxy`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence


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
