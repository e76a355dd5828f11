"""A prefill or decode rank in its own process, for the fault tests: it starts rooms, then
keeps them in flight (prefill never sends the last chunk) until it is killed.

    python rank.py prefill BOOTSTRAP_URL ROOM...     (the bootstrap service is in the test)
    python rank.py prefill-layers BOOTSTRAP_URL ROOM...   (only the first layer of a chunk)
    python rank.py decode  BOOTSTRAP_URL ROOM...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from kv_cache import rank_cache

from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager

GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)


def main() -> None:
    role, url, rooms = sys.argv[1], sys.argv[2], [int(room) for room in sys.argv[3:]]
    config = ManagerConfig(engine="nixl", bootstrap_url=url)
    if role.startswith("prefill"):
        cache = rank_cache(num_pages=32, seed=5, **GEOMETRY)
        prefill = PrefillManager(cache.args, config)
        layers = range(0, 1) if role == "prefill-layers" else None  # killed mid-forward
        for room in rooms:
            # never the last chunk (or layer)
            prefill.sender(room).send([2 * room, 2 * room + 1], layers=layers)
    else:
        cache = rank_cache(num_pages=32, seed=None, **GEOMETRY)
        decode = DecodeManager(cache.args, config)
        for room in rooms:
            decode.receiver(room).init([room, room + 8, room + 16])
    print("ready", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
