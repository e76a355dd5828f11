"""How long each engine takes to register a KV cache's memory: 16 GiB and 64 GiB.

    .venv/bin/python benchmarks/registration.py [--sizes-gib 16 64]

A rank registers its pages once, when its manager starts (`RankRuntime.register`, reported as
`kvbridge_registration_seconds`), never on a request's path. The memory here is laid out as
a serving engine's KV cache is: one buffer per layer for K and one for V (Llama-3-8B: 64
buffers), each registered as a region. It is reserved without being backed (anonymous,
MAP_NORESERVE, never written), so that 64 GiB can be asked for on a machine with less: what
is timed is the engine's registration of that many bytes. Engines that pin pages for RDMA
would also fault every page in; with no RDMA device here, NIXL's UCX and Mooncake's TCP do
not pin, and the figures say so. Mooncake runs in a private network namespace (it binds
wildcard listeners; root only). Writes bench-results/registration.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from typing import Any

from kvbridge.cache.regions import MemoryRegion
from kvbridge.engines import PROCESS_ENGINES, create_engine, engine_spec
from kvbridge.engines.base import rdma_device_present
from kvbridge_tools.bench import engine_unavailable, json_in_private_netns
from kvbridge_tools.bench_results import save

BUFFERS = 64  # Llama-3-8B: K and V of 32 layers


MAP_NORESERVE = 0x4000  # <sys/mman.h>: reserve address space, not memory


def reserve(size: int) -> int:
    """`size` bytes of address space, never backed unless written: its address."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"cannot reserve {size >> 30} GiB of address space")
    return int(address)


def release(address: int, size: int) -> None:
    libc = ctypes.CDLL(None)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap(ctypes.c_void_p(address), size)


def measure(engine_name: str, size_gib: int) -> dict[str, Any]:
    """Register (and deregister) `size_gib` of reserved memory as `BUFFERS` regions."""
    size = size_gib << 30
    base = reserve(size)
    try:
        step = size // BUFFERS
        regions = [MemoryRegion(base + index * step, step) for index in range(BUFFERS)]
        started = time.perf_counter()
        engine = create_engine(engine_name, f"registration-{os.getpid()}")
        created_s = time.perf_counter() - started
        try:
            started = time.perf_counter()
            engine.register(regions)
            register_s = time.perf_counter() - started
            started = time.perf_counter()
            engine.deregister(regions)
            deregister_s = time.perf_counter() - started
        finally:
            engine.close()
        return {
            "engine": engine_name,
            "gib": size_gib,
            "regions": BUFFERS,
            "engine_start_s": round(created_s, 3),
            "register_s": round(register_s, 4),
            "deregister_s": round(deregister_s, 4),
            "rdma_device": rdma_device_present(),
        }
    finally:
        release(base, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # one engine's rows, as JSON
    options = parser.parse_args()
    if options.engine:
        print(json.dumps([measure(options.engine, size) for size in options.sizes_gib]))
        return
    rows: list[dict[str, Any]] = []
    for engine in PROCESS_ENGINES:
        reason = engine_unavailable(engine)
        if reason is not None:
            print(f"{engine}: skipped ({reason})")
            continue
        arguments = [__file__, "--engine", engine, "--sizes-gib", *map(str, options.sizes_gib)]
        if engine_spec(engine).needs_own_netns:
            rows += json_in_private_netns(arguments)
        else:
            rows += [measure(engine, size) for size in options.sizes_gib]
    print("engine | GiB | regions | register s | deregister s | engine start s")
    print("--- | --- | --- | --- | --- | ---")
    for row in rows:
        print(
            f"{row['engine']} | {row['gib']} | {row['regions']} | {row['register_s']} | "
            f"{row['deregister_s']} | {row['engine_start_s']}"
        )
    pinned = any(row["rdma_device"] for row in rows)
    print("(no RDMA device: the engines register without pinning pages)" if not pinned else "")
    print(f"wrote {save('registration', {'rows': rows})}", file=sys.stderr)


if __name__ == "__main__":
    main()
