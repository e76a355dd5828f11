"""One side of the partition test, run inside its own network namespace; JSON lines on
stdin (commands) and stdout (answers).

    python partition_peer.py prefill HOST            → {"bootstrap": url}
    python partition_peer.py decode HOST BOOTSTRAP   → {"ready": true}
commands: {"start": [rooms], "last": bool}   {"wait": [rooms], "timeout": seconds}
          {"wait": [rooms], "timeout": seconds, "reach": "Transferring"}  (or further)
          {"clear": [rooms]}  → {"open_rooms": rooms left in the manager's table}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from kv_cache import rank_cache

from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import KVPoll

GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    role, host = sys.argv[1], sys.argv[2]
    rooms: dict[int, Any] = {}
    if role == "prefill":
        cache = rank_cache(num_pages=64, seed=5, **GEOMETRY)
        manager: Any = PrefillManager(
            cache.args,
            ManagerConfig(engine="mooncake", host=host, run_bootstrap=True, write_timeout_s=5),
        )
        say(bootstrap=manager.bootstrap_url)
    else:
        cache = rank_cache(num_pages=64, seed=None, **GEOMETRY)
        manager = DecodeManager(
            cache.args, ManagerConfig(engine="mooncake", host=host, bootstrap_url=sys.argv[3])
        )
        say(ready=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            for room in command["start"]:
                if role == "prefill":
                    rooms[room] = manager.sender(room)
                    rooms[room].send([room % 32, room % 32 + 32], last=command["last"])
                else:
                    rooms[room] = manager.receiver(room)
                    rooms[room].init([2 * (room % 32), 2 * (room % 32) + 1])
            say(started=command["start"])
        elif "clear" in command:
            for room in command["clear"]:
                rooms.pop(room).clear()
            say(open_rooms=manager.open_rooms)
        else:
            deadline = time.monotonic() + command["timeout"]
            wanted = [rooms[room] for room in command["wait"]]
            reach = KVPoll[command.get("reach", "Success")]
            while time.monotonic() < deadline and not all(
                r.poll() == KVPoll.Failed or r.poll() >= reach for r in wanted
            ):
                time.sleep(0.02)
            say(**{str(r.room): [r.poll().name, r.failure_reason] for r in wanted})


if __name__ == "__main__":
    main()
