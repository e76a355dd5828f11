"""The real transfer engine integration and fault tests run on (the loopback engine is for
unit tests only), and the module-level skip where it cannot be used."""

from __future__ import annotations

import pytest

from kvbridge.engines import unavailable_reason

ENGINE = "nixl"  # installed by `make test` from pinned wheels; needs no system library


def require_engine(engine: str = ENGINE) -> None:
    """Skip the calling test module, with the engine's own reason, where it cannot run."""
    reason = unavailable_reason(engine)
    if reason is not None:
        pytest.skip(f"{engine} cannot be used here: {reason}", allow_module_level=True)
