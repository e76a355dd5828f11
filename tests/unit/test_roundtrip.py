"""Every message of every profile survives encode → decode, and canonical frames survive
decode → encode, for any values the layout can carry."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_strategies import all_layouts, layout_id, messages_of

from kvbridge.wire import NATIVE, Layout, Profile, decode_frames, encode_frames
from kvbridge.wire.sglang import ZmqMessage

LAYOUTS = all_layouts()


@pytest.mark.parametrize(("profile", "layout"), LAYOUTS, ids=[layout_id(p) for p in LAYOUTS])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_decode_of_encode_is_identity(
    profile: Profile, layout: Layout[Any], data: st.DataObject
) -> None:
    message = data.draw(messages_of(layout))
    frames = layout.encode(message)
    assert all(isinstance(frame, bytes) for frame in frames)
    assert layout.decode(frames) == message
    # The profile tells the message type from the frames alone (as they go on the socket:
    # the native header, NIXL's guard).
    assert profile.decode(profile.encode(message)) == message
    # And so does the profile-detecting entry point, on the frames as they go on the socket.
    assert decode_frames(encode_frames(message, profile.name)) == message
    if isinstance(message, ZmqMessage):
        assert type(message).from_zmq(message.to_zmq()) == message


@pytest.mark.parametrize(("profile", "layout"), LAYOUTS, ids=[layout_id(p) for p in LAYOUTS])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_encode_of_decode_gives_back_canonical_frames(
    profile: Profile, layout: Layout[Any], data: st.DataObject
) -> None:
    frames = encode_frames(data.draw(messages_of(layout)), profile.name)
    assert encode_frames(decode_frames(frames), profile.name) == frames


@settings(max_examples=100, deadline=None)
@given(data=st.data(), secret=st.binary(min_size=1, max_size=64))
def test_native_round_trip_with_auth_tag(data: st.DataObject, secret: bytes) -> None:
    layout = data.draw(st.sampled_from(NATIVE.layouts))
    message = data.draw(messages_of(layout))
    frames = NATIVE.encode(message, secret=secret)
    assert NATIVE.decode(frames, secret=secret) == message
    again = encode_frames(decode_frames(frames, secret=secret), NATIVE.name, secret)
    assert again[:-1] == frames[:-1]  # the tag differs: a fresh nonce and timestamp
    assert decode_frames(again, secret=secret) == message
