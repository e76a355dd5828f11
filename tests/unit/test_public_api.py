"""The curated public API: every name `kvbridge` exports resolves to the object of the module
it lives in, and importing the package alone loads none of the managers' dependencies."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvbridge
from kvbridge.cache import KVArgs
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import KVPoll


def test_every_exported_name_resolves() -> None:
    for name in kvbridge.__all__:
        assert getattr(kvbridge, name) is not None, name
    assert kvbridge.KVArgs is KVArgs
    assert kvbridge.PrefillManager is PrefillManager
    assert kvbridge.DecodeManager is DecodeManager
    assert kvbridge.KVPoll is KVPoll
    assert set(kvbridge.__all__) <= set(dir(kvbridge))
    assert set(kvbridge.__all__) == {"__version__", *kvbridge._EXPORTS}


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="PrefillManagr"):
        kvbridge.PrefillManagr  # type: ignore[attr-defined]  # noqa: B018


def test_importing_the_package_stays_light() -> None:
    code = (
        "import sys, kvbridge, kvbridge.wire\n"
        "heavy = [m for m in ('zmq', 'kvbridge.prefill', 'kvbridge.decode') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
