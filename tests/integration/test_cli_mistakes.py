"""The ordinary mistakes a newcomer makes with the CLI, each ending in one line that says what
went wrong and what to do: exit status 2 for usage errors, 1 for failures, no traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def kvbridge(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvbridge", *args]
    if user is not None:
        command = ["setpriv", "--reuid", user, "--regid", user, "--clear-groups", *command]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def said_once(done: subprocess.CompletedProcess[str], status: int, *words: str) -> None:
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], errors[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    holder = socket.create_server(("127.0.0.1", 0))
    yield holder.getsockname()[1]
    holder.close()


def test_a_port_in_use(busy_port: int) -> None:
    said_once(kvbridge("bootstrap", "--port", str(busy_port)), 1, "in use", "another")


def test_a_bad_host() -> None:
    said_once(kvbridge("bootstrap", "--host", "not a host"), 2, "--host", "not an IP address")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root to run the command as another user",
)
def test_a_privileged_port_as_a_normal_user() -> None:
    said_once(kvbridge("bootstrap", "--port", "1", user="65534"), 1, "1024")


def test_an_unwritable_bench_output_is_refused_before_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    said_once(
        kvbridge("bench", "--preset", "smoke", "--output", str(blocker / "results")),
        2,
        "--output",
        "cannot write",
    )


def test_verbose_after_the_command_gets_a_hint() -> None:
    said_once(kvbridge("demo", "-vv"), 2, "before the command", "kvbridge -vv demo")


def test_an_odd_number_of_hex_digits() -> None:
    said_once(kvbridge("inspect", "313"), 2, "odd number of hex digits")


def test_an_empty_frames_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.frames"
    empty.write_text("")
    said_once(kvbridge("inspect", "--file", str(empty)), 2, "empty")


def test_an_unknown_message_type_lists_the_types() -> None:
    done = kvbridge("inspect", "--type", "nosuch", "3132")
    said_once(done, 2, "nosuch", "TransferStatus")


def test_every_option_has_help_and_every_command_an_example() -> None:
    import click

    from kvbridge.cli.main import app

    context = click.Context(app)
    for name, command in app.commands.items():
        assert "Example" in (command.help or ""), name
        for parameter in command.params:
            if isinstance(parameter, click.Option):
                assert parameter.help, f"{name} {parameter.opts}"
        assert command.get_help(context)


def test_an_engine_option_the_engine_does_not_have() -> None:
    said_once(
        kvbridge("demo", "--engine-option", "progres_thread=on"),
        2,
        "--engine-option for nixl",
        "no option 'progres_thread'",
        "(its options: progress_thread)",
    )
    said_once(
        kvbridge("demo", "--engine-option", "progress_thread=maybe"),
        2,
        "progress_thread='maybe'",
        "off, on",
    )


def test_an_engine_option_without_a_value() -> None:
    said_once(kvbridge("demo", "--engine-option", "progress_thread"), 2, "not NAME=VALUE")


def test_cross_layer_kv_between_tp_sizes() -> None:
    said_once(
        kvbridge("demo", "--cross-layer", "--prefill-tp", "2", "--decode-tp", "4"),
        2,
        "--cross-layer moves whole blocks",
        "equal TP sizes",
    )
