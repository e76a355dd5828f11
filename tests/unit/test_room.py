"""Per-room state: monotone KVPoll, sticky failure, chunk bookkeeping."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.prefill_room import TRANSITIONS, LifecycleError, Phase, PrefillRoom, Step
from kvbridge.core.room import Chunk, Failure, RoomStatus, Unpaired
from kvbridge.wire import FailureKind, KVPoll, TransferRequest
from kvbridge.wire.notifications import notification_for, parse_notification


def test_status_only_moves_forward_and_failure_sticks() -> None:
    status = RoomStatus()
    assert status.advance(KVPoll.Transferring)
    assert not status.advance(KVPoll.WaitingForInput)
    assert status.fail(FailureKind.ENGINE, "engine error")
    assert not status.advance(KVPoll.Success)
    assert not status.fail(FailureKind.TIMEOUT, "second reason")
    assert (status.poll, status.failure_kind, status.failure_reason) == (
        KVPoll.Failed,
        FailureKind.ENGINE,
        "engine error",
    )
    done = RoomStatus()
    done.advance(KVPoll.Success)
    assert not done.fail(FailureKind.ABORTED, "too late")
    assert done.failure_kind is None
    with pytest.raises(ValueError, match="needs a reason"):
        done.advance(KVPoll.Failed)


def request(peer: str, pages: list[int], aux: int | None = 0) -> TransferRequest:
    return TransferRequest(1, peer, False, np.array(pages, np.int32), aux, [[4]], 1)


def test_prefill_room_slices_destination_pages_per_chunk() -> None:
    room = PrefillRoom(1)
    room.add_chunk(Chunk(np.array([7, 8]), last=False))
    assert room.next_jobs() == []  # no request yet
    room.on_request(request("d0", [10, 11, 12]), aligned=True)
    assert room.status.poll == KVPoll.WaitingForInput
    (first,) = room.next_jobs()
    assert (first.page_offset, first.dst_pages.tolist()) == (0, [10, 11, 12])
    assert first.dst_aux_index is None
    room.add_chunk(Chunk(np.array([9]), last=True, aux_index=5, state_indices=(2,)))
    (second,) = room.next_jobs()  # the next chunk may go while the first one moves
    assert (second.chunk_idx, second.page_offset) == (1, 2)
    assert (second.src_aux_index, second.dst_aux_index) == (5, 0)
    assert (second.src_state_indices, second.dst_state_indices) == ((2,), (4,))
    room.maybe_succeed(open_jobs=1)  # the last chunk's write ended first
    assert room.status.poll == KVPoll.Transferring  # the first one is still out
    room.maybe_succeed(open_jobs=0)
    assert room.status.poll == KVPoll.Success
    with pytest.raises(ValueError, match="after the last chunk"):
        room.add_chunk(Chunk(np.array([1]), last=True))


def test_decode_prefix_pages_are_skipped_and_offsets_count_from_the_prefix() -> None:
    # Decode already holds the first 8 tokens (2 pages of 4): it asks for the pages after them.
    room = PrefillRoom(1, page_size=4)
    with_prefix = TransferRequest(1, "d0", False, np.array([30, 31, 32], np.int32), 0, [], 1, 8)
    assert room.request_problem(with_prefix, dst_page_size=8) is None
    room.on_request(with_prefix, aligned=True)
    room.add_chunk(Chunk(np.array([1]), last=False))  # room page 0: inside the prefix
    room.add_chunk(Chunk(np.array([2, 3]), last=False))  # pages 1 (prefix) and 2
    room.add_chunk(Chunk(np.array([4, 5]), last=True, aux_index=7))  # pages 3 and 4
    first, last = room.next_jobs()  # the first chunk had nothing to send
    assert (first.src_pages.tolist(), first.page_offset) == ([3], 0)
    assert (last.src_pages.tolist(), last.page_offset, last.src_aux_index) == ([4, 5], 1, 7)
    room.maybe_succeed(open_jobs=0)
    assert room.status.poll == KVPoll.Success


def test_a_prefix_covering_the_whole_room_still_sends_the_last_chunk() -> None:
    room = PrefillRoom(1, page_size=4)
    room.on_request(
        TransferRequest(1, "d0", False, np.array([], np.int32), 2, [], 1, 8), aligned=True
    )
    room.add_chunk(Chunk(np.array([1, 2]), last=True, aux_index=0))
    (job,) = room.next_jobs()  # no pages, but the aux slot and the room's end
    assert (job.src_pages.size, job.last, job.dst_aux_index) == (0, True, 2)


def test_a_prefix_that_splits_a_page_is_refused() -> None:
    room = PrefillRoom(1, page_size=16)
    request = TransferRequest(1, "d0", False, np.array([3], np.int32), None, [], 1, 24)
    problem = room.request_problem(request, dst_page_size=8)
    assert problem == (
        "room 1: decode_prefix_len 24 does not end on one of this prefill rank's pages of 16 tokens"
    )
    # A DCP decode rank's pages hold page_size × dcp_size tokens of the request.
    request = TransferRequest(1, "d0", False, np.array([3], np.int32), None, [], 1, 32)
    assert room.request_problem(request, 16, dst_dcp_size=4) == (
        "room 1: decode_prefix_len 32 does not end on one of decode's pages of 64 tokens"
    )


def test_dummy_requests_get_no_write_and_finish_with_the_last_chunk() -> None:
    room = PrefillRoom(1)
    room.add_chunk(Chunk(np.array([1, 2]), last=False))  # chunks queued before the request
    room.add_chunk(Chunk(np.array([3]), last=True))
    room.on_request(
        TransferRequest(1, "d0", True, np.array([], np.int32), None, [], 1), aligned=True
    )
    assert room.next_jobs() == []
    room.maybe_succeed(open_jobs=0)
    assert room.status.poll == KVPoll.Success


def test_decode_room_needs_every_rank_and_notification() -> None:
    room = DecodeRoom(1, frozenset({0, 1}), notifying_ranks=frozenset({0, 1}), deadline=10.0)
    room.on_status(0, KVPoll.Success, "")
    room.on_status(1, KVPoll.Success, "")
    room.on_status(7, KVPoll.Failed, "not ours")  # a rank this room does not wait for
    assert room.status.poll != KVPoll.Success
    room.on_notification(0)
    room.on_notification(1)
    assert room.status.poll == KVPoll.Success


def test_decode_room_failure_and_deadline() -> None:
    room = DecodeRoom(1, frozenset({0}), notifying_ranks=frozenset(), deadline=10.0)
    room.on_status(0, KVPoll.Failed, "write timed out", FailureKind.ENGINE)
    assert room.status.failure_reason == "prefill rank 0: write timed out"
    assert room.status.failure_kind == FailureKind.ENGINE  # prefill's kind, carried over
    unsaid = DecodeRoom(1, frozenset({0}), notifying_ranks=frozenset(), deadline=10.0)
    unsaid.on_status(0, KVPoll.Failed, "")  # a peer that gives no kind (SGLang, kvbridge/1.1)
    assert unsaid.status.failure_kind == FailureKind.UNKNOWN
    late = DecodeRoom(2, frozenset({0, 3}), notifying_ranks=frozenset(), deadline=1.0)
    late.on_status(0, KVPoll.Success, "")
    late.check_deadline(2.0)
    assert "prefill ranks [3]" in str(late.status.failure_reason)
    assert late.status.failure_kind == FailureKind.TIMEOUT


def test_notifications_round_trip() -> None:
    assert parse_notification(notification_for(42, 3)) == (42, 3, False)
    assert parse_notification(notification_for(42, 3, complete=True)) == (42, 3, True)
    assert notification_for(42, 3) == b"kvbridge:42:3"  # what kvbridge 1.2 decoders parse
    for other in (b"kvbridge:x:1", b"other", b"kvbridge:1:2:done", b"kvbridge:1:2:complete:x"):
        assert parse_notification(other) is None


def test_a_complete_notification_is_the_ranks_success_report() -> None:
    room = DecodeRoom(1, frozenset({0, 1}), notifying_ranks=frozenset({0, 1}), deadline=10.0)
    room.on_notification(0, complete=True)
    assert room.status.poll != KVPoll.Success  # rank 1 has said nothing yet
    room.on_notification(1)
    assert room.status.poll != KVPoll.Success  # a plain notification still needs the status
    room.on_status(1, KVPoll.Success, "")
    assert room.status.poll == KVPoll.Success
    assert room.settled == {0, 1}
    dummy = DecodeRoom(2, frozenset({0, 1}), notifying_ranks=frozenset({0}), deadline=10.0)
    dummy.on_notification(1, complete=True)  # rank 1 only tells about the room: not from it
    dummy.on_notification(0, complete=True)
    assert dummy.status.poll != KVPoll.Success
    assert dummy.reported == {0}


def test_pages_of_a_dead_rank_are_safe_only_when_its_lease_ran_out() -> None:
    room = DecodeRoom(1, frozenset({0, 1}), frozenset(), deadline=100.0)
    room.status.advance(KVPoll.Transferring)
    assert not room.pages_safe(0.0)  # in flight
    room.on_rank_dead(0, "prefill 0 silent", fenced_at=10.0)
    assert (room.status.poll, room.status.failure_kind) == (KVPoll.Failed, FailureKind.PEER_DEAD)
    assert room.unsettled() == [1]  # the dead rank gets no abort; the live one does
    room.on_abort_ack(1)
    assert not room.pages_safe(9.9)  # rank 0 may be hung, not dead: its lease still runs
    assert room.pages_safe(10.0)
    room.on_rank_dead(0, "again", fenced_at=50.0)  # declared dead twice: the first time holds
    assert room.pages_safe(10.0)


def test_a_dead_rank_that_confirms_is_settled_at_once() -> None:
    room = DecodeRoom(1, frozenset({0}), frozenset(), deadline=100.0)
    room.on_rank_dead(0, "prefill 0 silent", fenced_at=10.0)
    room.on_status(0, KVPoll.Failed, "it came back and reported")
    assert room.pages_safe(0.0)


def test_skipped_positions_are_not_written_and_the_rest_stay_one_run() -> None:
    # Decode needs room pages 1, 2 and 5 of six (a merged room of two groups, each with a
    # block decode has): -1 marks the others.
    room = PrefillRoom(1, page_size=4)
    request = TransferRequest(
        1, "d0", False, np.array([-1, 40, 41, -1, -1, 42], np.int32), 3, [], 1
    )
    assert room.request_problem(request, dst_page_size=4) is None
    room.on_request(request, aligned=True)
    room.add_chunk(Chunk(np.array([10, 11, 12]), last=False))  # room pages 0-2
    room.add_chunk(Chunk(np.array([13, 14, 15]), last=True, aux_index=0))  # 3-5
    first, last = room.next_jobs()
    assert (first.src_pages.tolist(), first.page_offset) == ([11, 12], 0)
    assert (last.src_pages.tolist(), last.page_offset) == ([15], 2)
    assert first.dst_pages.tolist() == last.dst_pages.tolist() == [40, 41, 42]


def test_skipped_positions_with_a_prefix_and_past_decodes_list() -> None:
    room = PrefillRoom(1, page_size=2)
    # The first 4 tokens (2 pages) are decode's; of the rest it needs the 2nd and the 3rd.
    request = TransferRequest(1, "d0", False, np.array([-1, 7, 8], np.int32), None, [], 1, 4)
    room.on_request(request, aligned=True)
    room.add_chunk(Chunk(np.arange(6), last=True))  # a page more than decode's list covers
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset, job.dst_pages.tolist()) == ([3, 4], 0, [7, 8])


def test_skipped_positions_need_one_page_size_and_no_dcp() -> None:
    room = PrefillRoom(1, page_size=4)
    request = TransferRequest(1, "d0", False, np.array([-1, 3], np.int32), None, [], 1)
    assert room.request_problem(request, dst_page_size=8) == (
        "room 1: decode skips pages inside the room (page index -1), which needs pages of one "
        "size on both sides and no DCP: this prefill rank's pages hold 4 tokens, decode's 8 "
        "(DCP 1)"
    )
    assert room.request_problem(request, 4, dst_dcp_size=2) is not None
    negative = TransferRequest(1, "d0", False, np.array([-2, 3], np.int32), None, [], 1)
    assert room.request_problem(negative, dst_page_size=4) == (
        "room 1: decode page index -2 (only -1 skips a page)"
    )


def test_pages_prefill_does_not_hold_go_nowhere_where_decode_needs_nothing() -> None:
    # A sliding window: prefill dropped the blocks of room pages 0 and 1 (-1), decode needs
    # only pages 2-4 of its window; a page past decode's list may be missing too.
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [-1, -1, 20, 21, 22]), aligned=True)
    room.add_chunk(Chunk(np.array([-1, -1, 5, 6, 7, -1]), last=True, aux_index=0))
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset, job.dst_pages.tolist()) == (
        [5, 6, 7],
        0,
        [20, 21, 22],
    )
    # Decode without gaps, whose list ends before the missing page: nothing is missed.
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [20, 21]), aligned=True)
    room.add_chunk(Chunk(np.array([5, 6, -1]), last=True, aux_index=0))
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset) == ([5, 6], 0)


@pytest.mark.parametrize("pages", [[-1, 20, 21], [20, 21, 22]])
def test_a_page_decode_needs_and_prefill_does_not_hold_is_refused(pages: list[int]) -> None:
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", pages), aligned=True)
    room.add_chunk(Chunk(np.array([5, -1, 7]), last=True, aux_index=0))
    with pytest.raises(Unpaired, match="room 1: decode needs the page at position 1 of its pages"):
        room.next_jobs()


def test_pages_prefill_does_not_hold_need_aligned_pages() -> None:
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [20, 21]), aligned=False)  # decode's pages hold 8 tokens
    room.add_chunk(Chunk(np.array([-1, 5, 6, 7]), last=True, aux_index=0))
    with pytest.raises(Unpaired, match="need pages of one size on both sides and no DCP"):
        room.next_jobs()


def test_pages_not_held_in_decodes_prefix_and_in_layer_ranges() -> None:
    # Decode holds the first 8 tokens (2 pages of 4) and needs the next 3 pages but the 2nd.
    room = PrefillRoom(1, page_size=4, num_layers=2)
    with_prefix = TransferRequest(1, "d0", False, np.array([30, -1, 32], np.int32), 0, [], 1, 8)
    room.on_request(with_prefix, aligned=True)
    room.add_chunk(Chunk(np.array([-1, 1]), last=False))  # inside the prefix: nothing needed
    assert room.next_jobs() == []
    room.add_chunk(Chunk(np.array([2, -1, 4]), last=False, layers=(0, 1)))
    (layer0,) = room.next_jobs()
    assert (layer0.src_pages.tolist(), layer0.page_offset) == ([2, 4], 0)
    room.add_chunk(Chunk(np.array([2, -1, 4]), last=True, aux_index=0, layers=(1, 2)))
    (layer1,) = room.next_jobs()
    assert (layer1.src_pages.tolist(), layer1.layers) == ([2, 4], (1, 2))
    # One decode needs: the first layer range fails, no job for any of them.
    room = PrefillRoom(1, page_size=4, num_layers=2)
    room.on_request(request("d0", [30, 31]), aligned=True)
    room.add_chunk(Chunk(np.array([2, -1]), last=False, layers=(0, 1)))
    with pytest.raises(Unpaired, match="position 1 of its pages"):
        room.next_jobs()


def test_pages_laid_out_by_position_need_aligned_pages_and_pair_page_for_page() -> None:
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [20, 21, 22]), aligned=True)
    room.add_chunk(Chunk(np.array([5, 6, 7]), last=True, aux_index=0, positional=True))
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset) == ([5, 6, 7], 0)
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [20, 21]), aligned=False)
    room.add_chunk(Chunk(np.array([5, 6, 7]), last=True, aux_index=0, positional=True))
    with pytest.raises(Unpaired, match="pair with decode's page for page"):
        room.next_jobs()
    assert room.aligns_with(4)
    assert not room.aligns_with(8)
    assert not room.aligns_with(4, 2)  # DCP


def test_a_chunk_placed_out_of_order_pairs_at_its_position() -> None:
    # Three page lists of 2 pages laid end to end; the middle one streams by layers first,
    # the others go after it, each at its own position.
    room = PrefillRoom(1, page_size=4, num_layers=2)
    room.on_request(request("d0", [20, 21, 22, 23, 24, 25]), aligned=True)
    streamed = np.array([7, 8])
    room.add_chunk(Chunk(streamed, False, layers=(0, 1), positional=True, position=2))
    room.add_chunk(Chunk(streamed, False, layers=(1, 2), positional=True, position=2))
    jobs = room.next_jobs()
    assert [(job.layers, job.page_offset) for job in jobs] == [((0, 1), 2), ((1, 2), 2)]
    room.add_chunk(Chunk(np.array([5, 6]), False, positional=True, position=0))
    room.add_chunk(Chunk(np.array([9, 10]), True, 0, (3,), positional=True, position=4))
    before, after = room.next_jobs()
    assert (before.src_pages.tolist(), before.page_offset, before.last) == ([5, 6], 0, False)
    assert (after.src_pages.tolist(), after.page_offset, after.last) == ([9, 10], 4, True)
    assert after.src_state_indices == (3,)
    # Unplaced, a chunk goes after the furthest page placed so far.
    room = PrefillRoom(1, page_size=4)
    room.on_request(request("d0", [20, 21, 22, 23]), aligned=True)
    room.add_chunk(Chunk(np.array([7]), False, positional=True, position=1))
    room.add_chunk(Chunk(np.array([8]), False, positional=True))
    room.add_chunk(Chunk(np.array([6]), True, 0, positional=True, position=0))
    assert [job.page_offset for job in room.next_jobs()] == [1, 2, 0]


def test_placed_chunks_send_each_position_once_and_leave_none_out() -> None:
    room = PrefillRoom(1, page_size=4)
    room.add_chunk(Chunk(np.array([7, 8]), False, positional=True, position=2))
    with pytest.raises(ValueError, match=r"positions 3\.\.3 sent, but positions 2\.\.3 were sent"):
        room.add_chunk(Chunk(np.array([9]), False, positional=True, position=3))
    with pytest.raises(ValueError, match=r"no chunk sent the pages for position 0 \(of 4"):
        room.add_chunk(Chunk(np.array([5]), True, 0, positional=True, position=1))
    assert not room.last_queued  # refused: nothing queued
    room.add_chunk(Chunk(np.array([5, 6]), True, 0, positional=True, position=0))
    assert room.last_queued


def test_placed_chunks_skip_decodes_prefix_at_their_positions() -> None:
    # Decode holds the first 3 pages' tokens (12 of 4 a page): its pages begin at position 3.
    room = PrefillRoom(1, page_size=4, num_layers=2)
    with_prefix = TransferRequest(1, "d0", False, np.array([30, 31, 32], np.int32), 0, [], 1, 12)
    room.on_request(with_prefix, aligned=True)
    streamed = np.array([7, 8, 9])  # positions 2..4: the first one is in the prefix
    room.add_chunk(Chunk(streamed, False, layers=(0, 2), positional=True, position=2))
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset) == ([8, 9], 0)
    room.add_chunk(Chunk(np.array([5, 6]), False, positional=True, position=0))
    assert room.next_jobs() == []  # all in the prefix
    room.add_chunk(Chunk(np.array([10]), True, 0, positional=True, position=5))
    (job,) = room.next_jobs()
    assert (job.src_pages.tolist(), job.page_offset) == ([10], 2)


def test_the_layers_of_a_placed_chunk_go_to_one_position() -> None:
    room = PrefillRoom(1, page_size=4, num_layers=2)
    room.add_chunk(Chunk(np.array([7, 8]), False, layers=(0, 1), positional=True, position=2))
    with pytest.raises(ValueError, match="same position"):
        room.add_chunk(Chunk(np.array([7, 8]), True, 0, layers=(1, 2), positional=True))


def test_a_prefill_room_moves_only_through_its_transition_table() -> None:
    for phase in Phase:
        for step in Step:
            room = PrefillRoom(1, phase=phase)
            if (phase, step) in TRANSITIONS:
                assert room.step(step) is TRANSITIONS[phase, step]
            else:
                with pytest.raises(LifecycleError, match=step.value):
                    room.step(step)
    # An open room is failed before it is cleared; nothing leaves FORGOTTEN.
    assert (Phase.OPEN, Step.CLEAR) not in TRANSITIONS
    assert not [key for key in TRANSITIONS if key[0] is Phase.FORGOTTEN]
    # Every phase but OPEN is reached, and every path ends in FORGOTTEN.
    assert {to for to in TRANSITIONS.values()} == set(Phase) - {Phase.OPEN}
    reachable = {Phase.FORGOTTEN}
    while True:
        more = {phase for (phase, _), to in TRANSITIONS.items() if to in reachable}
        if more <= reachable:
            break
        reachable |= more
    assert reachable == set(Phase)


def test_a_room_that_fails_with_a_write_out_drains_before_it_settles() -> None:
    room = PrefillRoom(1)
    room.on_request(request("d0", [10, 11]), aligned=True)
    room.add_chunk(Chunk(np.array([7, 8]), last=True))
    room.next_jobs()  # its job is out
    assert room.fail(Failure(FailureKind.ABORTED, "aborted"))
    assert (room.phase, room.pages_safe) == (Phase.FAILED_DRAINING, False)
    assert room.step(Step.CLEAR) is Phase.CLEARED_DRAINING
    assert not room.fail(Failure(FailureKind.TIMEOUT, "later"))  # the first failure stands
    assert room.status.failure_kind == FailureKind.ABORTED
    assert room.step(Step.DRAINED) is Phase.FORGOTTEN
    assert room.pages_safe


def test_the_lifecycle_table_in_the_architecture_doc_is_the_code_s() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| ([A-Z_]+) \| ([a-z]+) \| ([A-Z_]+) \|$", doc, re.MULTILINE)
    documented = {(Phase[phase], Step(step)): Phase[to] for phase, step, to in rows}
    assert documented == TRANSITIONS
