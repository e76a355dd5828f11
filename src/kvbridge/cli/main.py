"""`kvbridge`: inspect wire messages and generate the protocol document."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

import kvbridge
from kvbridge import samples
from kvbridge.wire import PROFILES, WireError, inspect_frames
from kvbridge.wire.framefile import FrameFileError, load_frames, parse_hex_frame
from kvbridge.wire.profile import Inspection
from kvbridge.wire.protocol_doc import render_protocol

SECRET_ENV = "KVBRIDGE_SECRET"

app = typer.Typer(
    help="kvbridge: the KV-cache transfer plane between prefill and decode workers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
error_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        console.print(f"kvbridge {kvbridge.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show version.")
    ] = False,
) -> None:
    """kvbridge command line."""


def _fail(message: str) -> typer.Exit:
    error_console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


def _read_frames(
    hex_frames: list[str], file: Path | None, sample: str | None
) -> tuple[list[bytes], dict[str, object]]:
    sources = sum([bool(hex_frames), file is not None, sample is not None])
    if sources != 1:
        raise _fail("give the frames one way: hex arguments, --file PATH, or --sample NAME")
    try:
        if sample is not None:
            try:
                return load_frames(samples.sample_bytes(sample))
            except KeyError:
                known = ", ".join(samples.sample_names())
                raise _fail(f"no sample {sample!r}; bundled samples: {known}") from None
        if file is not None:
            data = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
            return load_frames(data)
        return [parse_hex_frame(text, i) for i, text in enumerate(hex_frames)], {}
    except (FrameFileError, OSError) as exc:
        raise _fail(str(exc)) from None


def _render(result: Inspection, description: str | None) -> None:
    title = f"{result.profile} · {result.type_name or 'unknown message'}"
    table = Table(title=title, title_justify="left", caption=description)
    table.add_column("frame", justify="right")
    table.add_column("field")
    table.add_column("codec")
    table.add_column("bytes", justify="right")
    table.add_column("value", overflow="fold")
    for row in result.rows:
        value = row.value if row.error is None else f"[red]{row.error}[/red]"
        raw_length = "missing" if row.raw_length is None else str(row.raw_length)
        table.add_row(str(row.index), row.field, row.codec, raw_length, value)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    if result.ok:
        console.print("[green]valid[/green]")
    else:
        for error in result.errors:
            console.print(f"[red]error:[/red] {error}", highlight=False)


@app.command("inspect")
def inspect_command(
    hex_frames: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer needs Optional on Python 3.10
        typer.Argument(help='Frames as hex strings, one argument each ("" = empty frame).'),
    ] = None,
    file: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--file", "-f", help="A frames file (JSON hex list or binary); - = stdin."),
    ] = None,
    sample: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--sample", "-s", help="A bundled sample (see `kvbridge samples`)."),
    ] = None,
    profile: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--profile", "-p", help=f"Profile: {', '.join(PROFILES)}; default: detect."),
    ] = None,
    message_type: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--type", "-t", help="Message type; default: detect from the frames."),
    ] = None,
) -> None:
    """Show a message frame by frame: index, field, codec, raw length, decoded value.

    Exits 0 when the message is valid, 1 when it is malformed, 2 on unusable input.
    """
    frames, metadata = _read_frames(hex_frames or [], file, sample)
    if not frames:
        raise _fail("no frames given")
    chosen_profile = profile or metadata.get("profile")
    chosen_type = message_type or metadata.get("type")
    secret = os.environ.get(SECRET_ENV)
    try:
        result = inspect_frames(
            frames,
            str(chosen_profile) if chosen_profile else None,
            str(chosen_type) if chosen_type else None,
            secret.encode() if secret else None,
        )
    except WireError as exc:
        raise _fail(str(exc)) from None
    description = metadata.get("description")
    _render(result, str(description) if description else None)
    if not result.ok:
        raise typer.Exit(1)


@app.command("samples")
def samples_command() -> None:
    """List the bundled sample messages."""
    for name in samples.sample_names():
        _, metadata = load_frames(samples.sample_bytes(name))
        console.print(f"{name}: {metadata.get('description', '')}", highlight=False)


@app.command("protocol-doc")
def protocol_doc_command(
    output: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--output", "-o", help="Write the document here (default: stdout)."),
    ] = None,
    check: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--check", help="Exit 1 if this file differs from the generated document."),
    ] = None,
) -> None:
    """Generate the protocol document (docs/PROTOCOL.md) from the layouts."""
    document = render_protocol()
    if check is not None:
        if not check.exists() or check.read_text() != document:
            error_console.print(f"{check} is stale: run `make docs`", highlight=False)
            raise typer.Exit(1)
        console.print(f"{check} is up to date", highlight=False)
        return
    if output is None:
        sys.stdout.write(document)
    else:
        output.write_text(document)
        console.print(f"wrote {output}", highlight=False)
