"""The scheduler side hands prefill's sends to the workers over real sockets: every worker
gets each send at once; a message without the instance's token, or malformed, is dropped with
a reason and the inbox keeps serving."""

from __future__ import annotations

import queue
import time

import pytest
import zmq

from kvbridge.integrations.vllm_handoff import SendInbox, SendOutbox
from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.integrations.vllm_steps import SendSpec

SEND = SendSpec("req-1", 2**62 + 5, ((3, 4, 5), (9,)))


def test_send_round_trips_and_malformed_sends_say_why() -> None:
    assert SendSpec.decode(SEND.encode()) == SEND
    for data, why in [
        (b"\xff", "not JSON"),
        (b"[" * 100_000, "not JSON"),  # nested past Python's recursion limit
        (b"[1]", "not a JSON object"),
        (b'{"room": 1}', "needs a request_id"),
        (b'{"request_id": "r", "room": 1, "blocks": [3]}', "list of lists"),
        (b'{"request_id": "r", "room": -1, "blocks": []}', "integers"),
        (b'{"request_id": "r", "room": 1, "blocks": [[true]]}', "integers"),
    ]:
        with pytest.raises(OptionsError, match=why):
            SendSpec.decode(data)


def test_every_worker_gets_each_send_and_forgeries_are_dropped() -> None:
    got: list[queue.SimpleQueue[SendSpec]] = [queue.SimpleQueue(), queue.SimpleQueue()]
    inboxes = [SendInbox("127.0.0.1", q.put) for q in got]
    outbox = SendOutbox()
    forger = zmq.Context.instance().socket(zmq.PUSH)
    try:
        assert outbox.send(SEND) is not None  # no worker named yet: refused with a reason
        for rank, inbox in enumerate(inboxes):
            outbox.connect((0, rank), inbox.address, inbox.token)
        forger.connect(inboxes[0].address)
        forger.send_multipart([b"not-the-token", SEND.encode()])
        forger.send(b"garbage")
        # With the token, a send that would blow Python's stack: dropped, the inbox lives.
        forger.send_multipart([inboxes[0].token.encode(), b"[" * 100_000])
        assert outbox.send(SEND) is None
        for q in got:
            assert q.get(timeout=5) == SEND
        deadline = time.monotonic() + 5  # the forger's connection is not ordered with ours
        while inboxes[0].refused < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inboxes[0].refused == 3
        assert inboxes[0].alive
        assert got[0].empty()  # neither forgery got through...
        second = SendSpec("req-2", 1, ((1,),))
        assert outbox.send(second) is None  # ...and the inbox still serves
        assert got[0].get(timeout=5) == second
    finally:
        forger.close(linger=0)
        outbox.close()
        for inbox in inboxes:
            inbox.close()


def test_a_failing_worker_callback_stops_no_later_send() -> None:
    taken: queue.SimpleQueue[str] = queue.SimpleQueue()

    def take(send: SendSpec) -> None:
        if send.request_id == "bad":
            raise RuntimeError("boom")
        taken.put(send.request_id)

    inbox = SendInbox("127.0.0.1", take)
    outbox = SendOutbox()
    try:
        outbox.connect((0, 0), inbox.address, inbox.token)
        outbox.send(SendSpec("bad", 1, ((1,),)))
        outbox.send(SendSpec("good", 2, ((1,),)))
        assert taken.get(timeout=5) == "good"
    finally:
        outbox.close()
        inbox.close()
