"""Logging set-up for kvbridge's own processes (the CLI and the demo's rank processes); a
host application configures logging itself."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def level_for(verbosity: int) -> int:
    """`-v` count → level: warnings and errors only by default, -v INFO, -vv DEBUG."""
    return {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)


def configure(level: int) -> None:
    """kvbridge's loggers at `level` to stderr; other libraries' stay at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("kvbridge").setLevel(level)
