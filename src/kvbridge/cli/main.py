"""`kvbridge`: inspect wire messages and generate the protocol document."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import kvbridge
from kvbridge import samples
from kvbridge.bench import (
    ENGINES,
    PRESETS,
    CellResult,
    cells,
    default_engines,
    markdown,
    plot,
    run_matrix,
    write_json,
)
from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.demo import MEMORY_KINDS, MODELS, DemoConfig, DemoConfigError, run_demo
from kvbridge.engines import unavailable_reason
from kvbridge.logs import configure as configure_logging
from kvbridge.logs import level_for
from kvbridge.wire import PROFILES, WireError, inspect_frames
from kvbridge.wire.auth import secret_from_env
from kvbridge.wire.framefile import FrameFileError, load_frames, parse_hex_frame
from kvbridge.wire.profile import Inspection
from kvbridge.wire.protocol_doc import render_protocol

console = Console()
error_console = Console(stderr=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(kvbridge.__version__, prog_name="kvbridge")
@click.option("-v", "--verbose", count=True,
              help="Log more: -v rooms and peers (INFO), -vv every message (DEBUG).")  # fmt: skip
@click.pass_context
def app(context: click.Context, verbose: int) -> None:
    """kvbridge: the KV-cache transfer plane between prefill and decode workers."""
    context.obj = level_for(verbose)
    configure_logging(context.obj)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every cleanup path runs."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _interrupted(exc: KeyboardInterrupt, what: str) -> click.exceptions.Exit:
    """The conventional exit status of a process ended by the signal: 128 + its number."""
    received = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    error_console.print(f"{received.name}: {what}", highlight=False)
    return click.exceptions.Exit(128 + received)


def main() -> None:
    """The `kvbridge` command: SIGTERM stops it as cleanly as Ctrl-C does."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    app(prog_name="kvbridge")


def _fail(message: str) -> click.exceptions.Exit:
    error_console.print(f"[red]error:[/red] {message}", highlight=False)
    return click.exceptions.Exit(2)


def _read_frames(
    hex_frames: tuple[str, ...], file: str | None, sample: str | None
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
            data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
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
@click.argument("hex_frames", nargs=-1)
@click.option("--file", "-f", help="A frames file (JSON hex list or binary); - = stdin.")
@click.option("--sample", "-s", help="A bundled sample (see `kvbridge samples`).")
@click.option("--profile", "-p", type=click.Choice(list(PROFILES)), help="Default: detect.")
@click.option("--type", "-t", "message_type", help="Message type; default: detect.")
def inspect_command(
    hex_frames: tuple[str, ...],
    file: str | None,
    sample: str | None,
    profile: str | None,
    message_type: str | None,
) -> None:
    """Show a message frame by frame: index, field, codec, raw length, decoded value.

    HEX_FRAMES are the frames as hex strings, one argument each ("" = an empty frame).
    Exits 0 when the message is valid, 1 when it is malformed, 2 on unusable input.
    Native messages with an auth tag are verified when $KVBRIDGE_SECRET is set.
    """
    frames, metadata = _read_frames(hex_frames, file, sample)
    if not frames:
        raise _fail("no frames given")
    chosen_profile = profile or metadata.get("profile")
    chosen_type = message_type or metadata.get("type")
    secret = secret_from_env()
    try:
        result = inspect_frames(
            frames,
            str(chosen_profile) if chosen_profile else None,
            str(chosen_type) if chosen_type else None,
            secret,
        )
    except WireError as exc:
        raise _fail(str(exc)) from None
    description = metadata.get("description")
    _render(result, str(description) if description else None)
    if not result.ok:
        raise click.exceptions.Exit(1)


@app.command("samples")
def samples_command() -> None:
    """List the bundled sample messages."""
    for name in samples.sample_names():
        _, metadata = load_frames(samples.sample_bytes(name))
        console.print(f"{name}: {metadata.get('description', '')}", highlight=False)


@app.command("protocol-doc")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="Write it here.")
@click.option(
    "--check",
    type=click.Path(path_type=Path),
    help="Exit 1 if this file differs from the generated document.",
)
def protocol_doc_command(output: Path | None, check: Path | None) -> None:
    """Generate the protocol document (docs/PROTOCOL.md) from the layouts."""
    document = render_protocol()
    if check is not None:
        if not check.exists() or check.read_text() != document:
            error_console.print(f"{check} is stale: run `make docs`", highlight=False)
            raise click.exceptions.Exit(1)
        console.print(f"{check} is up to date", highlight=False)
        return
    if output is None:
        sys.stdout.write(document)
    else:
        output.write_text(document)
        console.print(f"wrote {output}", highlight=False)


@app.command("demo")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="llama3-8b", show_default=True)
@click.option("--requests", "-n", type=click.IntRange(1), default=16, show_default=True)
@click.option("--tokens", "-l", type=click.IntRange(1), default=1024, show_default=True,
              help="Tokens per request.")  # fmt: skip
@click.option("--page-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True,
              help="Attention-TP size of both groups.")  # fmt: skip
@click.option("--prefill-tp", type=click.IntRange(1), help="Prefill attention-TP (default: --tp).")
@click.option("--decode-tp", type=click.IntRange(1), help="Decode attention-TP (default: --tp).")
@click.option("--engine", type=click.Choice(["nixl", "mooncake"]), default="nixl",
              show_default=True)  # fmt: skip
@click.option("--dcp", type=click.IntRange(1), default=1, show_default=True,
              help="Decode context parallelism: processes per decode TP rank.")  # fmt: skip
@click.option("--staging/--no-staging", default=True, show_default=True,
              help="Staging path where the TP sizes differ.")  # fmt: skip
@click.option("--chunks", type=click.IntRange(1), default=2, show_default=True,
              help="Chunks each request is sent in (chunked prefill).")  # fmt: skip
@click.option("--memory", type=click.Choice(MEMORY_KINDS), default="host", show_default=True,
              help="Where the KV cache lives: numpy arrays, torch CPU tensors, a GPU.")  # fmt: skip
@click.pass_obj
def demo_command(
    log_level: int,
    model: str,
    requests: int,
    tokens: int,
    page_size: int,
    tp: int,
    prefill_tp: int | None,
    decode_tp: int | None,
    engine: str,
    dcp: int,
    staging: bool,
    chunks: int,
    memory: str,
) -> None:
    """Move the KV cache of N requests from a prefill group to a decode group (separate
    processes, a real engine) and verify every byte. Exits 1 on any failure or mismatch."""
    config = DemoConfig(
        model=model, requests=requests, tokens=tokens, page_size=page_size,
        prefill_tp=prefill_tp or tp, decode_tp=decode_tp or tp, engine=engine, chunks=chunks,
        staging=staging, dcp=dcp, log_level=log_level, memory=memory,
    )  # fmt: skip
    reason = unavailable_reason(engine)
    if reason is not None:
        raise _fail(f"engine {engine} cannot be used here: {reason}")
    try:
        config.check()
    except DemoConfigError as exc:
        raise _fail(str(exc)) from None
    footprint = config.kv_bytes_per_rank(config.prefill_tp) / 2**30
    console.print(
        f"{config.shape.name}: {requests} requests × {tokens} tokens, page {page_size}, "
        f"TP {config.prefill_tp}→{config.decode_tp}, DCP {config.dcp}, engine {engine}; "
        f"{footprint:.2f} GiB of KV "
        "per prefill rank",
        highlight=False,
    )
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rooms verified", total=requests * config.decode_ranks)
        try:
            result = run_demo(config, lambda done: progress.update(task, completed=done))
        except KeyboardInterrupt as exc:
            raise _interrupted(exc, "demo stopped, rank processes ended") from None
    table = Table(title="kvbridge demo", title_justify="left")
    for column in ("requests", "bytes", "GB/s", "p50 ms", "p99 ms", "engine", "verified"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    transports = sorted({r.transport for r in result.reports if r.transport})
    table.add_row(
        str(sum(r.rooms for r in result.decode_reports)),
        f"{result.total_bytes / 2**30:.2f} GiB",
        f"{result.gbps:.2f}",
        f"{result.latency_ms(0.5):.1f}",
        f"{result.latency_ms(0.99):.1f}",
        f"{engine}: {', '.join(transports)}",
        "[green]all bytes[/green]" if result.ok else "[red]NO[/red]",
    )
    console.print(table)
    staged = sum(r.staged_chunks for r in result.reports)
    fallbacks = sum(r.staging_fallbacks for r in result.reports)
    if staged or fallbacks:
        console.print(f"staging: {staged} chunks staged, {fallbacks} sent token by token",
                      highlight=False)  # fmt: skip
    for report in result.reports:
        for room, why in sorted(report.failed_rooms.items()):
            console.print(f"[red]{report.role} {report.rank} room {room} failed:[/red] {why}")
        if report.mismatched_rooms:
            console.print(f"[red]decode {report.rank}: wrong bytes in rooms "
                          f"{report.mismatched_rooms}[/red]")  # fmt: skip
        if report.error:
            console.print(f"[red]{report.role} {report.rank}: {report.error}[/red]")
    if not result.ok:
        raise click.exceptions.Exit(1)


@app.command("bench")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="quick", show_default=True,
              help="smoke: seconds; quick: ~1 min per engine; full: all of it.")  # fmt: skip
@click.option("--engine", "engines", multiple=True, type=click.Choice(ENGINES),
              help="Engines to measure (repeatable). Default: every installed one for "
                   "full, the first installed (NIXL) for smoke and quick.")  # fmt: skip
@click.option("--output", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True,
              help="Folder for bench.json, bench.md and bench.png.")  # fmt: skip
@click.pass_obj
def bench_command(log_level: int, preset: str, engines: tuple[str, ...], output: Path) -> None:
    """Benchmark matrix: for each cell, kvbridge end to end (separate processes, bytes
    verified) against the raw engine moving the identical blocks. Prints a table, writes
    JSON and PNG plots. Exits 1 if any cell failed."""
    chosen = engines or default_engines(preset)
    if not chosen:
        raise _fail("no transfer engine is installed (pip install nixl-cu12 or mooncake)")
    planned = len(cells(PRESETS[preset], chosen))
    rows: list[CellResult] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("cells", total=planned)

        def done(row: CellResult) -> None:
            progress.update(task, advance=1, description=row.cell.label)

        try:
            rows.extend(run_matrix(preset, chosen, done, log_level))
        except KeyboardInterrupt as exc:
            raise _interrupted(exc, "bench stopped, rank processes ended") from None
    table = Table(title=f"kvbridge bench ({preset})", title_justify="left")
    columns = ("engine", "model", "tokens", "page", "TP", "req", "GB/s", "raw GB/s", "ratio",
               "p50 ms", "p99 ms", "desc/req", "plan ms/req", "ctrl CPU ms/req")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("engine", "model") else "right")
    for row in rows:
        cell = row.cell
        head = (cell.engine, cell.model, str(cell.tokens), str(cell.page_size),
                f"{cell.prefill_tp}→{cell.decode_tp}")  # fmt: skip
        if row.skipped or row.error:
            why = f"[yellow]skipped: {row.skipped}[/yellow]" if row.skipped else (
                f"[red]failed: {row.error}[/red]")  # fmt: skip
            table.add_row(*head, "", why)
            continue
        table.add_row(
            *head, str(row.requests), f"{row.kvbridge_gbps:.2f}", f"{row.raw_gbps:.2f}",
            f"{row.ratio:.2f}" if row.ratio is not None else "-", f"{row.p50_ms:.1f}",
            f"{row.p99_ms:.1f}", f"{row.descriptors_per_request:g}",
            f"{row.plan_ms_per_request:.3f}", f"{row.control_cpu_ms_per_request:.2f}",
        )  # fmt: skip
    console.print(table)
    write_json(rows, preset, output / "bench.json")
    (output / "bench.md").write_text(markdown(rows))
    plot(rows, output / "bench.png")
    console.print(f"wrote {output}/bench.json, bench.md and bench.png", highlight=False)
    if any(row.error for row in rows):
        raise click.exceptions.Exit(1)


@app.command("bootstrap")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8998, show_default=True)
def bootstrap_command(host: str, port: int) -> None:
    """Run the bootstrap (rendezvous) service standalone until interrupted."""
    server = BootstrapServer(host, port, secret=secret_from_env())
    console.print(f"kvbridge bootstrap on {server.url}", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt as exc:  # the way to stop it: a clean exit, status 0
        received = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        console.print(f"{received}: bootstrap service stopped", highlight=False)
    finally:
        server.close()
