"""Bundled sample messages (frames files) for `kvbridge inspect --sample`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIX = ".json"


def sample_names() -> list[str]:
    folder = resources.files(__name__)
    return sorted(
        entry.name[: -len(SUFFIX)] for entry in folder.iterdir() if entry.name.endswith(SUFFIX)
    )


def sample_bytes(name: str) -> bytes:
    if name not in sample_names():
        raise KeyError(name)
    return resources.files(__name__).joinpath(name + SUFFIX).read_bytes()


def sample_folder() -> Path:
    return Path(str(resources.files(__name__)))
