"""The write jobs' table: what a room has open toward each decode rank."""

from __future__ import annotations

import numpy as np

from kvbridge.core.room import ChunkJob
from kvbridge.core.write_jobs import JobTable, WriteJob


def job(room: int, chunk: int, peer: str) -> ChunkJob:
    return ChunkJob(
        room=room,
        peer_id=peer,
        chunk_idx=chunk,
        src_pages=np.array([chunk]),
        page_offset=chunk,
        dst_pages=np.arange(4, dtype=np.int32),
        last=chunk == 3,
        src_aux_index=None,
        dst_aux_index=None,
        src_state_indices=(),
        dst_state_indices=(),
    )


def test_a_job_is_alone_toward_its_peer_once_the_rooms_other_jobs_there_ended() -> None:
    table = JobTable()
    jobs = [job(1, chunk, "a") for chunk in range(4)]
    for entry in [*jobs, job(1, 0, "b"), job(2, 0, "a")]:
        table.add(WriteJob(entry))
    last = jobs[-1]
    assert not table.alone_to_peer(last)
    for earlier in jobs[:-1]:
        table.forget(WriteJob(earlier).key)
    # The room's job toward another decode rank and another room's job do not count.
    assert table.alone_to_peer(last)
    assert table.alone_to_peer(job(1, 0, "b"))  # toward b, room 1 had only that one
    assert table.open_in(1) == 2
    table.forget(WriteJob(last).key)
    assert table.alone_to_peer(last)  # (nothing of the room left there at all)
