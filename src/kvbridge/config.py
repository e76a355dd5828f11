"""Configuration of the prefill and decode managers: every option, with its default."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbridge.cache.pairing import WRITE_PATHS
from kvbridge.engines import DEFAULT_ENGINE
from kvbridge.wire.auth import secret_from_env
from kvbridge.wire.sglang.common import SGLangProfile
from kvbridge.wire.sglang.mooncake import MOONCAKE
from kvbridge.wire.sglang.nixl import NIXL

# Decode's staging ring and prefill's staging buffer, each. At 64 MiB a TP 2→4 batch of the
# demo (16 × 1024 tokens of Llama-3-8B: 32 MiB per request and decode rank) kept prefill
# waiting for ring space and rooms finishing together: median request 0.35-0.54 s against
# 0.25-0.30 s at 128 or 256 MiB, GB/s the same within the noise (2026-12-04, README).
DEFAULT_STAGING_BYTES = 128 << 20
PEER_PROTOCOLS = ("kvbridge", "sglang")
# The engines kvbridge speaks to SGLang peers over, each in its own SGLang dialect.
SGLANG_PROFILES: dict[str, SGLangProfile] = {"mooncake": MOONCAKE, "nixl": NIXL}
SGLANG_ENGINES = tuple(SGLANG_PROFILES)


@dataclass(frozen=True)
class DataParallel:
    """A prefill rank's place in an SGLang prefill instance with data parallelism (DP
    attention): its DP rank of `size`, and how rooms are spread over the DP ranks — by room
    number modulo `size` (`follow_bootstrap_room`, sglang's default), or as the serving engine
    chooses, each rank registering the rooms it takes at the bootstrap service for decode to
    ask (sglang's other load-balance methods)."""

    rank: int = 0
    size: int = 1
    follow_bootstrap_room: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"data_parallel rank {self.rank} of {self.size}")

    def registers_rooms(self, force_query: bool) -> bool:
        """Whether each room this rank takes is registered with the bootstrap service
        (`force_query`: sglang's FORCE_QUERY_PREFILL_DP_RANK, mixed routing)."""
        return self.size > 1 and (force_query or not self.follow_bootstrap_room)

    def room_problem(self, room: int, force_query: bool) -> str | None:
        """Why this rank cannot take `room` (None: it can): following bootstrap rooms without
        mixed routing, decode asks the room's number modulo the DP size — sglang's conflict."""
        if not self.follow_bootstrap_room or force_query or room % self.size == self.rank:
            return None
        return (
            f"follow_bootstrap_room conflict: dispatched to DP rank {self.rank} but bootstrap "
            f"room {room} implies DP rank {room % self.size} (set "
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 on both sides for mixed "
            "routing)"
        )


@dataclass(frozen=True)
class ManagerConfig:
    """What a manager needs beyond its KV geometry.

    engine: transfer engine name (nixl, mooncake; loopback for unit tests in one process).
    engine_options: the engine's own options, by name (`kvbridge.engines.REGISTRY` lists
        them: Mooncake's protocol tcp|rdma and device, NIXL's progress_thread); unset ones take
        their defaults, an unknown one is refused when the manager starts.
    host: address this rank's control socket binds and advertises.
    bootstrap_url: the prefill group's bootstrap service (prefill registers there; decode
        receivers use it unless given another).
    run_bootstrap: prefill rank 0 starts the bootstrap service itself, on `bootstrap_port`
        (0: any free port; the URL is then `PrefillManager.bootstrap_url`).
    bootstrap_timeout_s: how long to wait for the prefill group to be complete.
    transfer_timeout_s: how long decode waits for a room after sending its request.
    request_timeout_s: how long a prefill room waits for decode's transfer request(s).
    write_timeout_s: how long prefill waits for one engine write.
    writes_in_flight: write jobs a prefill rank hands out per decode peer at once (to the
        engine, or waiting for ring space): the next are planned and gathered while earlier
        ones move; enough for a room's chunks (which may go as one transfer) and one more.
        Rooms toward a peer are written oldest first, so they complete in the order they
        arrived.
    staging: open the staging buffers (decode registers a ring, prefill gathers a chunk into
        one write); off: every head slice is a separate block.
    write_path: how prefill writes a chunk (`kvbridge.cache.pairing`): "auto" (between TP
        sizes through the staging buffers, equal TP as planned blocks), "direct" (planned
        blocks always: a page run, head slice or token row each) or "coalesced" (gathered,
        one block into decode's ring, scattered there, wherever the layout's token rows
        allow: MHA and MLA, equal TP included; needs staging).
    write_costs: a calibration file of what each path costs, by memory kind
        (`kvbridge.cache.costs.load_costs`); None: the defaults measured for host memory
        over CMA and for an H200 over cuda_ipc. "auto" chooses by them for pages of every head.
    staging_bytes: decode's ring, and prefill's local staging buffer, in bytes; a chunk that
        does not fit falls back to the per-token path.
    staging_timeout_s: how long prefill waits for ring space for one chunk.
    staging_kernels: gather/scatter kernels of the staging path: "auto" (numpy on host memory,
        torch on GPU memory), "numpy" or "torch" (torch needs KVArgs.from_torch).
    heartbeat_interval_s: how often a rank tells each peer it is alive.
    peer_timeout_s: a peer silent this long is declared dead and its rooms fail (both sides).
    metrics_port: serve Prometheus metrics on (host, this port); 0 picks a free port (see
        `manager.metrics.port`); None (the default): no server.
    secret: shared secret (default: $KVBRIDGE_SECRET): control messages carry and require
        an auth tag (HMAC, timestamp, nonce); bootstrap registrations need the derived token.
    peer_protocol: what the peers speak: "kvbridge" (kvbridge ranks) or "sglang" (sglang
        0.5.23's own PD transfer layer, over Mooncake: `bootstrap_url` is then an SGLang
        bootstrap address `host:port`, messages are sglang's frames; SGLang peers carry no
        secret, heartbeats or write leases: docs/trust-model.md says what holds).
    data_parallel: a prefill rank's DP rank in an SGLang prefill instance (`DataParallel`);
        SGLang peers only.
    """

    engine: str = DEFAULT_ENGINE
    engine_options: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    bootstrap_url: str | None = None
    run_bootstrap: bool = False
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    write_timeout_s: float = 60.0
    writes_in_flight: int = 4
    staging: bool = True
    write_path: str = "auto"
    write_costs: str | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    staging_timeout_s: float = 30.0
    staging_kernels: str = "auto"
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 3.0
    metrics_port: int | None = None
    secret: bytes | None = field(default_factory=secret_from_env, repr=False)
    peer_protocol: str = "kvbridge"
    data_parallel: DataParallel = field(default_factory=DataParallel)

    def __post_init__(self) -> None:
        if self.writes_in_flight < 1:
            raise ValueError(f"writes_in_flight must be at least 1, got {self.writes_in_flight}")
        if self.write_path not in WRITE_PATHS:
            raise ValueError(
                f"write_path must be one of {', '.join(WRITE_PATHS)}, got {self.write_path!r}"
            )
        if self.write_path == "coalesced" and (not self.staging or self.sglang_peers):
            raise ValueError(
                "write_path 'coalesced' goes through the staging buffers: it needs staging on "
                "and kvbridge peers (SGLang's decode ranks have no staging ring)"
            )
        if self.peer_protocol not in PEER_PROTOCOLS:
            raise ValueError(
                f"peer_protocol must be one of {', '.join(PEER_PROTOCOLS)}, "
                f"got {self.peer_protocol!r}"
            )
        if self.data_parallel.size > 1 and not self.sglang_peers:
            raise ValueError(
                "data_parallel is an SGLang prefill instance's: kvbridge groups are told apart "
                "by their bootstrap URLs (peer_protocol 'sglang' for SGLang peers)"
            )
        if self.sglang_peers:
            if self.engine not in SGLANG_ENGINES:
                raise ValueError(
                    f"SGLang peers move KV over {', '.join(SGLANG_ENGINES)} here, not "
                    f"{self.engine!r}"
                )
            if self.secret:
                raise ValueError(
                    "SGLang peers carry no secret (sglang's frames have no auth tag): unset "
                    "KVBRIDGE_SECRET / ManagerConfig.secret for peer_protocol 'sglang'"
                )

    @property
    def sglang_peers(self) -> bool:
        return self.peer_protocol == "sglang"

    @property
    def exposed_without_secret(self) -> bool:
        """Whether this rank binds beyond loopback with no secret: then anyone who can reach
        its ports is trusted (the README's trust model)."""
        if self.secret:
            return False
        try:
            return not ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return self.host != "localhost"

    def warn_if_exposed(self, logger: logging.Logger, role: str) -> None:
        if self.exposed_without_secret:
            logger.warning(
                "%s rank binds %s without a secret: anyone who can reach its ports is trusted "
                "(set KVBRIDGE_SECRET or ManagerConfig.secret)",
                role,
                self.host,
            )
