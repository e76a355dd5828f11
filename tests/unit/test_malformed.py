"""Bad input: decoding raises only WireError (or decodes, where the layout allows it).

Every frame of every message of every profile is dropped, emptied, truncated, extended and
replaced by random bytes; then a fuzz run throws 100k mutated and random frame lists at the
decoders and at `inspect`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_strategies import all_layouts, corpus, layout_id, messages_of

from kvbridge import samples
from kvbridge.wire import (
    GUARD,
    NATIVE,
    NIXL,
    PROFILES,
    Layout,
    Message,
    Profile,
    WireError,
    decode_frames,
    detect_profile,
    encode_frames,
    inspect_frames,
)
from kvbridge.wire.framefile import load_frames

LAYOUTS = all_layouts()
Mutation = Callable[[list[bytes], int, random.Random], list[bytes]]


def _drop(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    return frames[:i] + frames[i + 1 :]


def _empty(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    return [*frames[:i], b"", *frames[i + 1 :]]


def _truncate(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    cut = rng.randrange(len(frames[i])) if frames[i] else 0
    return [*frames[:i], frames[i][:cut], *frames[i + 1 :]]


def _extend(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    tail = rng.randbytes(rng.randint(1, 9))
    return [*frames[:i], frames[i] + tail, *frames[i + 1 :]]


def _replace(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    return [*frames[:i], rng.randbytes(rng.randint(0, 40)), *frames[i + 1 :]]


def _append(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    return [*frames, rng.randbytes(rng.randint(0, 12))]


def _flip(frames: list[bytes], i: int, rng: random.Random) -> list[bytes]:
    if not frames[i]:
        return frames
    raw = bytearray(frames[i])
    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    return [*frames[:i], bytes(raw), *frames[i + 1 :]]


MUTATIONS: tuple[Mutation, ...] = (_drop, _empty, _truncate, _extend, _replace, _append, _flip)


def _decode_or_wire_error(decode: Callable[[], Message]) -> Message | None:
    """Only a valid message or a WireError is acceptable."""
    try:
        message = decode()
    except WireError as exc:
        error = exc
    else:
        assert isinstance(message, Message)
        return message
    # The error says where: a profile, and a frame or field unless the message as a whole
    # matched nothing.
    assert error.profile
    assert error.frame_index is not None or error.field or "match no message" in str(error)
    return None


def _check_all_entry_points(frames: Sequence[bytes], profile: Profile, layout: Layout[Any]) -> None:
    _decode_or_wire_error(lambda: decode_frames(frames))
    decoded = _decode_or_wire_error(lambda: decode_frames(frames, profile.name))
    if decoded is not None and profile is not NATIVE:
        # SGLang profiles: whatever they accept, they give back byte for byte (to_zmq).
        assert encode_frames(decoded, profile.name) == list(frames)
    if profile is not NATIVE:
        _decode_or_wire_error(lambda: layout.decode(frames))
    result = inspect_frames(frames, profile.name)
    # inspect reads the same layout table as decode: what decodes inspects without errors,
    # and what the profile refuses inspects with errors — except a NIXL message captured
    # without its guard frame (as sglang's from_zmq sees it), which inspect reads as the
    # frames after the guard and says so; those frames with the guard put back decode.
    if decoded is not None:
        assert result.ok, result.errors
    elif result.ok:
        assert profile is NIXL, (result.type_name, frames)
        assert result.notes[0].startswith("no guard frame"), result.notes
        assert _decode_or_wire_error(lambda: decode_frames([GUARD, *frames], NIXL.name))


@pytest.mark.parametrize(("profile", "layout"), LAYOUTS, ids=[layout_id(p) for p in LAYOUTS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_every_frame_mutated(
    profile: Profile, layout: Layout[Any], data: st.DataObject, seed: int
) -> None:
    rng = random.Random(seed)
    message = data.draw(messages_of(layout))
    frames = encode_frames(message, profile.name)
    for index in range(len(frames)):
        for mutation in MUTATIONS:
            _check_all_entry_points(mutation(frames, index, rng), profile, layout)


def test_dropping_a_required_frame_names_it() -> None:
    frames, _ = load_frames(samples.sample_bytes("sglang-mooncake-registration"))
    for index in range(10):  # frames 0-9 are required
        with pytest.raises(WireError) as caught:
            decode_frames(frames[:index] + frames[index + 1 :], "sglang-mooncake")
        assert caught.value.frame_index is not None


def test_non_bytes_frames_are_refused() -> None:
    with pytest.raises(WireError, match="frame 1"):
        decode_frames([b"12", "4", b"1"])  # type: ignore[list-item]
    with pytest.raises(WireError, match="empty message"):
        decode_frames([])
    with pytest.raises(WireError, match="single bytes object"):
        decode_frames(b"12")  # type: ignore[arg-type]


FUZZ_CASES = 100_000


def test_fuzz_100k_frame_lists() -> None:
    pool: list[list[bytes]] = [
        load_frames(samples.sample_bytes(name))[0] for name in samples.sample_names()
    ]
    pool += [encode_frames(message, profile) for profile, message in corpus(4)]
    profiles = list(PROFILES)
    rng = random.Random(20261130)
    decoded = refused = 0
    started = time.perf_counter()
    for case in range(FUZZ_CASES):
        if case % 10 == 0:
            frames = [
                rng.randbytes(rng.choice((0, 1, 4, 8, 16, 40))) for _ in range(rng.randint(0, 20))
            ]
            if frames and rng.random() < 0.5:  # reach past profile detection
                frames[0] = rng.choice(pool)[0]
        else:
            frames = list(rng.choice(pool))
            for _ in range(rng.randint(1, 3)):
                if frames:
                    frames = rng.choice(MUTATIONS)(frames, rng.randrange(len(frames)), rng)
        profile = rng.choice(profiles) if case % 3 == 0 else None
        result = _decode_or_wire_error(lambda f=frames, p=profile: decode_frames(f, p))
        if result is None:
            refused += 1
        else:
            decoded += 1
            chosen = profile or detect_profile(frames).name
            if chosen != NATIVE.name:  # SGLang profiles give back what they accepted
                assert encode_frames(result, chosen) == list(frames), frames
        if case % 20 == 0 and frames:
            inspect_frames(frames, profile)
    elapsed = time.perf_counter() - started
    print(f"fuzz: {FUZZ_CASES} frame lists, {decoded} decoded, {refused} refused, {elapsed:.1f} s")
    assert decoded > 0
    assert refused > 0
