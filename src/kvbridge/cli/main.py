"""`kvbridge`: inspect wire messages and generate the protocol document."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import kvbridge
from kvbridge import samples
from kvbridge.cache.pairing import WRITE_PATHS
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.engines import DEFAULT_ENGINE, PROCESS_ENGINES, REGISTRY, unavailable_reason
from kvbridge.integrations.vllm_proxy import UPSTREAM_TIMEOUT_S
from kvbridge.logs import configure as configure_logging
from kvbridge.logs import level_for
from kvbridge.wire import PROFILES, Receiver, WireError, inspect_frames
from kvbridge.wire.address import host_problem
from kvbridge.wire.auth import secret_from_env
from kvbridge.wire.framefile import FrameFileError, load_frames, parse_hex_frame
from kvbridge.wire.profile import Inspection
from kvbridge.wire.protocol_doc import render_protocol
from kvbridge_tools.bench import (
    ENGINES,
    PRESETS,
    CellResult,
    bench_document,
    cells,
    default_engines,
    markdown,
    plot,
    run_matrix,
    write_json,
)
from kvbridge_tools.demo import (
    MEMORY_KINDS,
    MODELS,
    DemoConfig,
    DemoConfigError,
    DemoResult,
    chunk_paths_text,
    run_demo,
)
from kvbridge_tools.layerwise import LayerwiseConfig, run_layerwise

console = Console()
error_console = Console(stderr=True)
# Every message type of every profile, for --type.
MESSAGE_TYPES = sorted(
    {layout.type_name for profile in PROFILES.values() for layout in profile.layouts}
)


def _is_verbose_flag(option: str) -> bool:
    return option == "--verbose" or (option.startswith("-v") and set(option[1:]) == {"v"})


class _Command(click.Command):
    """A subcommand: `-v` given after it gets a hint instead of a bare "no such option"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if not _is_verbose_flag(exc.option_name):
                raise
            raise click.UsageError(
                f"-v and -vv go before the command: kvbridge -vv {ctx.info_name} ...", ctx
            ) from None


class _Group(click.Group):
    """The `kvbridge` group: a failure inside a command is one line on stderr and exit
    status 1 (the traceback only with -vv); usage errors stay click's, exit status 2."""

    command_class = _Command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if isinstance(ctx.obj, int) and ctx.obj <= logging.DEBUG:
                raise
            error_console.print(f"[red]error:[/red] {_explain(exc)}", highlight=False)
            error_console.print(
                "(run with -vv before the command for the traceback)", style="dim", highlight=False
            )
            raise click.exceptions.Exit(1) from None


def _explain(exc: BaseException) -> str:
    """A failure in words: what went wrong and, for the common ones, what to do."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"{exc.strerror}: another process holds that port; choose another one"
    if isinstance(exc, PermissionError):
        return f"{exc}: ports below 1024 need root; choose a port of 1024 or more"
    name = type(exc).__name__
    return f"{exc}" if name.endswith("Error") and str(exc) else f"{name}: {exc}"


def _validate_host(ctx: click.Context, param: click.Parameter, value: str) -> str:
    problem = host_problem(value)
    if problem is not None:
        raise click.BadParameter(problem)
    return value


def _writable_folder(folder: Path) -> None:
    """Refuse, before a long run, a results folder that cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".kvbridge-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise click.BadParameter(
            f"cannot write results there: {exc.strerror or exc}", param_hint="--output"
        ) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(kvbridge.__version__, prog_name="kvbridge")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Log more: -v rooms and peers (INFO), -vv every message (DEBUG).",
)
@click.pass_context
def app(context: click.Context, verbose: int) -> None:
    """kvbridge: the KV-cache transfer plane between prefill and decode workers.

    Options such as -v go before the command. Exit status: 0 success, 1 a failure, 2 a usage
    error.

    \b
    Examples:
      kvbridge demo
      kvbridge -v demo --prefill-tp 2 --decode-tp 4
      kvbridge inspect --sample sglang-mooncake-registration
    """
    context.obj = level_for(verbose)
    configure_logging(context.obj)
    if verbose:  # the engines' own logs too (read when they load, in every rank process)
        os.environ.setdefault("MC_LOG_LEVEL", "INFO")
        os.environ.setdefault("NIXL_LOG_LEVEL", "INFO" if verbose == 1 else "DEBUG")


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
    try:
        app(prog_name="kvbridge")
    except BrokenPipeError:  # the reader went away (`kvbridge ... | head`): not an error here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


# Every process engine's options, for --engine-option's help (from the engine registry).
_ENGINE_OPTIONS_HELP = "; ".join(
    f"{spec.name}: "
    + ", ".join(
        f"{option.name}={'|'.join(option.choices) or 'TEXT'} (default {option.default!r})"
        for option in spec.options
    )
    for spec in REGISTRY.values()
    if spec.options and not spec.in_process_only
)


def _engine_options(
    context: click.Context, parameter: click.Parameter, values: tuple[str, ...]
) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values:
        name, equals, setting = value.partition("=")
        if not equals or not name:
            raise click.BadParameter(f"{value!r} is not NAME=VALUE", context, parameter)
        pairs.append((name, setting))
    return tuple(pairs)


def _fail(message: str) -> click.exceptions.Exit:
    error_console.print(f"[red]error:[/red] {message}", highlight=False)
    return click.exceptions.Exit(2)


# `--write-path` of the demo and the bench (ManagerConfig.write_path).
_write_path_option = click.option(
    "--write-path",
    type=click.Choice(WRITE_PATHS),
    default="auto",
    show_default=True,
    help="How prefill writes a chunk: auto (the cost model picks page runs or decode's ring "
    "for pages of every head; head slices between TP sizes through the ring), direct "
    "(planned blocks only) or coalesced (through decode's ring wherever it can). What each "
    "chunk took: the demo's chunks line, the bench's chunks by path.",
)


def _manager_config(**settings: Any) -> ManagerConfig:
    """The managers' settings from command-line options; one that cannot work fails here."""
    try:
        return ManagerConfig(**settings)
    except ValueError as exc:
        raise _fail(str(exc)) from None


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
@click.option(
    "--file", "-f", metavar="PATH", help="A frames file (JSON hex list or binary); - reads stdin."
)
@click.option("--sample", "-s", metavar="NAME", help="A bundled sample (see `kvbridge samples`).")
@click.option(
    "--profile",
    "-p",
    type=click.Choice(list(PROFILES)),
    help="Wire profile of the message. Default: detected.",
)
@click.option(
    "--type",
    "-t",
    "message_type",
    type=click.Choice(MESSAGE_TYPES),
    help="Message type. Default: detected.",
)
@click.option(
    "--to",
    "receiver",
    type=click.Choice([side.value for side in Receiver]),
    help="SGLang profiles: tell the message apart as that side's sglang listener "
    "does (an untagged message to decode is a status, to prefill a "
    "TransferInfo). Default: the file's `receiver` (a capture's), else either side.",
)
def inspect_command(
    hex_frames: tuple[str, ...],
    file: str | None,
    sample: str | None,
    profile: str | None,
    message_type: str | None,
    receiver: str | None,
) -> None:
    """Show a message frame by frame: index, field, codec, raw length, decoded value.

    HEX_FRAMES are the frames as hex strings, one argument each ("" = an empty frame).
    Exits 0 when the message is valid, 1 when it is malformed, 2 on unusable input.
    Native messages with an auth tag are verified when $KVBRIDGE_SECRET is set.

    \b
    Examples:
      kvbridge inspect --sample sglang-mooncake-registration
      kvbridge inspect 3132 34 31 --to decode   # room 12, Success, prefill rank 1
    """
    frames, metadata = _read_frames(hex_frames, file, sample)
    if not frames:
        raise _fail("no frames given")
    chosen_profile = profile or metadata.get("profile")
    chosen_type = message_type or metadata.get("type")
    chosen_receiver = receiver or metadata.get("receiver")
    if chosen_receiver is not None and chosen_receiver not in {side.value for side in Receiver}:
        raise _fail(f"the file's receiver {str(chosen_receiver)[:40]!r} is not prefill or decode")
    secret = secret_from_env()
    try:
        result = inspect_frames(
            frames,
            str(chosen_profile) if chosen_profile else None,
            str(chosen_type) if chosen_type else None,
            secret,
            Receiver(chosen_receiver) if chosen_receiver else None,
        )
    except WireError as exc:
        raise _fail(str(exc)) from None
    description = metadata.get("description")
    _render(result, str(description) if description else None)
    if not result.ok:
        raise click.exceptions.Exit(1)


@app.command("samples")
def samples_command() -> None:
    """List the bundled sample messages (frames captured in each profile's layout).

    \b
    Example:
      kvbridge samples
    """
    for name in samples.sample_names():
        _, metadata = load_frames(samples.sample_bytes(name))
        console.print(f"{name}: {metadata.get('description', '')}", highlight=False)


@app.command("engines")
def engines_command() -> None:
    """List the transfer engines, their options, and whether each can be used here.

    \b
    Example:
      kvbridge engines
    """
    for spec in REGISTRY.values():
        reason = unavailable_reason(spec.name)
        state = f"not available: {reason}" if reason else "available"
        console.print(f"{spec.name}: {spec.summary} — {state}", highlight=False)
        for option in spec.options:
            values = "|".join(option.choices) or "TEXT"
            console.print(
                f"  {option.name}={values} (default {option.default!r}): {option.help}",
                highlight=False,
            )


@app.command("protocol-doc")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="Write it here.")
@click.option(
    "--check",
    type=click.Path(path_type=Path),
    help="Exit 1 if this file differs from the generated document.",
)
def protocol_doc_command(output: Path | None, check: Path | None) -> None:
    """Generate the protocol document (docs/PROTOCOL.md) from the layouts.

    \b
    Examples:
      kvbridge protocol-doc | less
      kvbridge protocol-doc --check docs/PROTOCOL.md
    """
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
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default="llama3-8b",
    show_default=True,
    help="Model whose KV-cache shape is moved (layers, KV heads, head dim).",
)
@click.option(
    "--requests",
    "-n",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Requests (rooms) moved, all issued at once.",
)
@click.option(
    "--tokens",
    "-l",
    type=click.IntRange(1),
    default=1024,
    show_default=True,
    help="Tokens per request.",
)
@click.option(
    "--page-size",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Tokens per KV-cache page.",
)
@click.option(
    "--tp",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Attention-TP size of both groups (ranks per group).",
)
@click.option("--prefill-tp", type=click.IntRange(1), help="Prefill attention-TP (default: --tp).")
@click.option("--decode-tp", type=click.IntRange(1), help="Decode attention-TP (default: --tp).")
@click.option(
    "--engine",
    type=click.Choice(PROCESS_ENGINES),
    default=DEFAULT_ENGINE,
    show_default=True,
    help="Transfer engine that moves the bytes.",
)
@click.option(
    "--engine-option",
    "engine_options",
    multiple=True,
    metavar="NAME=VALUE",
    callback=_engine_options,
    help="An option of the engine (repeatable): " + _ENGINE_OPTIONS_HELP,
)
@click.option(
    "--dcp",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Decode context parallelism: processes per decode TP rank.",
)
@click.option(
    "--staging/--no-staging",
    default=True,
    show_default=True,
    help="Staging buffers (gathered writes; the staging path between TP sizes).",
)
@_write_path_option
@click.option(
    "--cross-layer",
    is_flag=True,
    help="Lay each rank's KV out block-outermost (every layer's page of a block side by side, "
    "as vLLM's BLHNC), one buffer of whole blocks: a run of pages is one descriptor for "
    "every layer. Equal TP, host memory.",
)
@click.option(
    "--chunks",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Chunks each request is sent in (chunked prefill).",
)
@click.option(
    "--memory",
    type=click.Choice(MEMORY_KINDS),
    default="host",
    show_default=True,
    help="Where the KV cache lives: numpy arrays, torch CPU tensors, a GPU.",
)
@click.option(
    "--layerwise",
    is_flag=True,
    help="Layer-wise writes during a simulated forward pass against whole-request writes after "
    "it, on the same requests (TP 1→1, one chunk each): the post-forward tail.",
)
@click.option(
    "--layer-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=4.0,
    show_default=True,
    help="With --layerwise: simulated compute time of one layer.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object to stdout instead of the table."
)
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
    engine_options: tuple[tuple[str, str], ...],
    dcp: int,
    staging: bool,
    write_path: str,
    cross_layer: bool,
    chunks: int,
    memory: str,
    layerwise: bool,
    layer_ms: float,
    as_json: bool,
) -> None:
    """Move the KV cache of N requests from a prefill group to a decode group (separate
    processes, a real engine) and verify every byte. Exits 1 on any failure or mismatch.
    With --layerwise, how much of the transfer is left after prefill's last layer.

    Sizes are in GB and rates in GB/s, both decimal (10^9 bytes).

    \b
    Examples:
      kvbridge demo
      kvbridge demo --prefill-tp 2 --decode-tp 4 --requests 8
      kvbridge demo --model deepseek-v3 --json
      kvbridge demo --layerwise --requests 4 --tokens 4096
    """
    config = DemoConfig(
        model=model,
        requests=requests,
        tokens=tokens,
        page_size=page_size,
        prefill_tp=prefill_tp or tp,
        decode_tp=decode_tp or tp,
        chunks=chunks,
        dcp=dcp,
        log_level=log_level,
        memory=memory,
        cross_layer=cross_layer,
        transfer=_manager_config(
            engine=engine,
            engine_options=dict(engine_options),
            staging=staging,
            write_path=write_path,
        ),
    )
    reason = unavailable_reason(engine)
    if reason is not None:
        raise _fail(f"engine {engine} cannot be used here: {reason}")
    if layerwise:
        _layerwise_demo(LayerwiseConfig(config, layer_ms), as_json)
        return
    try:
        config.check()
    except DemoConfigError as exc:
        raise _fail(str(exc)) from None
    footprint = config.kv_bytes_per_rank(config.prefill_tp) / 1e9
    plural = "s" if requests > 1 else ""
    status = error_console if as_json else console
    status.print(
        f"{config.shape.name}: {requests} request{plural} × {tokens} tokens, page {page_size}, "
        f"TP {config.prefill_tp}→{config.decode_tp}, DCP {config.dcp}, engine {engine}"
        f"{', cross-layer' if cross_layer else ''}; "
        f"{footprint:.2f} GB of KV per prefill rank",
        highlight=False,
    )
    with Progress(console=status, transient=True) as progress:
        task = progress.add_task("rooms verified", total=requests * config.decode_ranks)
        try:
            result = run_demo(config, lambda done: progress.update(task, completed=done))
        except KeyboardInterrupt as exc:
            raise _interrupted(exc, "demo stopped, rank processes ended") from None
    if as_json:
        sys.stdout.write(json.dumps(result.summary()) + "\n")
    else:
        _print_demo(result)
    if not result.ok:
        raise click.exceptions.Exit(1)


def _layerwise_demo(config: LayerwiseConfig, as_json: bool) -> None:
    """`demo --layerwise`: both modes on the same requests, the tails side by side."""
    try:
        config.check()
    except DemoConfigError as exc:
        raise _fail(str(exc)) from None
    demo = config.demo
    (error_console if as_json else console).print(
        f"{demo.shape.name}: {demo.requests} requests × {demo.tokens} tokens, each written "
        f"whole after a {demo.shape.layers}-layer forward of {config.layer_ms:g} ms per layer "
        f"and layer by layer during it, engine {demo.engine}",
        highlight=False,
    )
    try:
        summary = run_layerwise(config).summary()
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, "demo stopped, rank processes ended") from None
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        table = Table(title="kvbridge demo --layerwise", title_justify="left")
        for column in ("requests", "whole-request ms", "layer-wise tail ms", "tail ratio"):
            table.add_column(column, justify="right")
        ratio = summary["tail_ratio"]
        table.add_row(
            f"{summary['verified']}/{2 * demo.requests}",
            f"{summary['whole_request_ms'] or 0:.2f}",
            f"{summary['tail_ms'] or 0:.2f}",
            f"{ratio:.2f}" if ratio is not None else "—",
        )
        console.print(table)
        console.print(
            "tail: last layer computed → KV in place on decode (medians); ratio: the tail over "
            "the whole-request time per layer (1: only the last layer's share left)",
            highlight=False,
        )
        for role, errors in summary["errors"].items():
            if errors:
                console.print(f"[red]{role}: {errors}[/red]")
    if not summary["ok"]:
        raise click.exceptions.Exit(1)


def _print_demo(result: DemoResult) -> None:
    """The demo's summary: a table that fits 80 columns, then the engine and any failure."""
    table = Table(title="kvbridge demo", title_justify="left")
    for column in ("requests", "GB", "GB/s", "p50 ms", "p99 ms", "verified"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result.requests_verified}/{result.config.requests}",
        f"{result.total_bytes / 1e9:.2f}",
        f"{result.gbps:.2f}",
        f"{result.latency_ms(0.5):.1f}",
        f"{result.latency_ms(0.99):.1f}",
        "[green]all bytes[/green]" if result.ok else "[red]NO[/red]",
    )
    console.print(table)
    transports = ", ".join(sorted({r.transport for r in result.reports if r.transport}))
    console.print(f"engine: {result.config.engine} ({transports})", highlight=False)
    console.print(f"chunks: {chunk_paths_text(result.chunk_paths)}", highlight=False)
    for report in result.reports:
        for room, why in sorted(report.failed_rooms.items()):
            console.print(f"[red]{report.role} {report.rank} room {room} failed:[/red] {why}")
        if report.mismatched_rooms:
            console.print(
                f"[red]decode {report.rank}: wrong bytes in rooms {report.mismatched_rooms}[/red]"
            )
        if report.error:
            console.print(f"[red]{report.role} {report.rank}: {report.error}[/red]")


@app.command("vllm-proxy")
@click.option(
    "--prefill",
    "prefill",
    multiple=True,
    required=True,
    metavar="URL",
    help="A prefill vLLM instance, http://host:port (repeatable: fewest in flight first).",
)
@click.option(
    "--decode",
    "decode",
    multiple=True,
    required=True,
    metavar="URL",
    help="A decode vLLM instance, http://host:port (repeatable: fewest in flight first).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=_validate_host,
    help="Address the proxy listens on.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port the proxy listens on (0: a free one, printed).",
)
@click.option(
    "--upstream-timeout",
    "upstream_timeout_s",
    type=click.FloatRange(0, min_open=True),
    default=UPSTREAM_TIMEOUT_S,
    show_default=True,
    help="Seconds an instance may send nothing before its request ends with 504 (a hung instance).",
)
@click.option(
    "--prefill-bootstrap",
    "prefill_bootstrap",
    multiple=True,
    metavar="URL",
    help="Decode first: each --prefill instance's kvbridge bootstrap service, in the same order "
    "(its bootstrap_port); requests go to both instances at once and prefill writes each layer "
    "as it computes it (KVBridgeConnector only).",
)
@click.option(
    "--prefill-data-parallel-size",
    "prefill_dp_size",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Decode first: data-parallel ranks per --prefill instance (vllm serve "
    "--data-parallel-size); each request goes to one rank (X-data-parallel-rank) and decode "
    "asks that rank's bootstrap service (the instance's bootstrap port + the rank's index).",
)
def vllm_proxy_command(
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    host: str,
    port: int,
    upstream_timeout_s: float,
    prefill_bootstrap: tuple[str, ...],
    prefill_dp_size: int,
) -> None:
    """A PD proxy for vLLM instances: each OpenAI completion or chat request goes to a
    prefill instance (max_tokens 1, do_remote_decode), then to a decode instance with the
    kv_transfer_params of prefill's answer. Works with KVBridgeConnector and NixlConnector.

    \b
    Examples:
      kvbridge vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
      kvbridge vllm-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
          --prefill-bootstrap http://127.0.0.1:8998
    """
    from kvbridge.integrations.vllm_proxy import PDProxy

    try:
        proxy = PDProxy(
            prefill, decode, host, port, upstream_timeout_s, prefill_bootstrap, prefill_dp_size
        )
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from None
    console.print(
        f"kvbridge vllm-proxy on {proxy.url}: prefill {', '.join(prefill)}; decode "
        f"{', '.join(decode)}",
        highlight=False,
    )
    try:
        proxy.serve_forever()
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, "vllm-proxy") from None
    finally:
        proxy.shutdown()


@app.command("bench")
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default="quick",
    show_default=True,
    help="smoke: seconds; quick: ~1 min per engine; full: all of it.",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    type=click.Choice(ENGINES),
    help="Engines to measure (repeatable). Default: every installed one for "
    "full, the first installed (NIXL) for smoke and quick.",
)
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Folder for bench.json, bench.md and bench.png.",
)
@_write_path_option
@click.option(
    "--cross-layer",
    is_flag=True,
    help="Every cell's KV laid out block-outermost, one buffer of whole blocks (as the demo's "
    "--cross-layer); the cells of equal TP only.",
)
@click.option(
    "--wide",
    is_flag=True,
    help="Every column (descriptors, planning and control CPU per request); "
    "needs about 140 columns.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the results as one JSON document to stdout, not the table.",
)
@click.pass_obj
def bench_command(
    log_level: int,
    preset: str,
    engines: tuple[str, ...],
    output: Path,
    write_path: str,
    cross_layer: bool,
    wide: bool,
    as_json: bool,
) -> None:
    """Benchmark matrix: for each cell, kvbridge end to end (separate processes, bytes
    verified) against the raw engine moving the identical blocks. Prints a table, writes
    JSON, Markdown and PNG plots. Exits 1 if any cell failed. Rates in GB/s (10^9 B/s).

    \b
    Examples:
      kvbridge bench --preset smoke
      kvbridge bench --engine nixl --engine mooncake --wide
      kvbridge bench --preset smoke --json > results.json
    """
    chosen = engines or default_engines(preset)
    if not chosen:
        raise _fail("no transfer engine is installed (pip install nixl-cu12 or mooncake)")
    _writable_folder(output)
    planned = len(cells(PRESETS[preset], chosen, write_path, cross_layer))
    rows: list[CellResult] = []
    status = error_console if as_json else console
    with Progress(console=status, transient=True) as progress:
        task = progress.add_task("cells", total=planned)

        def done(row: CellResult) -> None:
            progress.update(task, advance=1, description=row.cell.label)

        try:
            rows.extend(run_matrix(preset, chosen, done, log_level, write_path, cross_layer))
        except KeyboardInterrupt as exc:
            raise _interrupted(exc, "bench stopped, rank processes ended") from None
    write_json(rows, preset, output / "bench.json")
    (output / "bench.md").write_text(markdown(rows))
    plot(rows, output / "bench.png")
    if as_json:
        sys.stdout.write(json.dumps(bench_document(rows, preset)) + "\n")
    else:
        console.print(_bench_table(rows, preset, wide))
        chunks: Counter[str] = Counter()
        for row in rows:
            chunks.update(row.chunks)
        console.print(f"chunks by path: {chunk_paths_text(chunks)}", highlight=False)
        for row in rows:
            if row.skipped or row.error:
                why = f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}"
                console.print(f"{row.cell.label}: {why}", highlight=False)
    status.print(f"wrote {output}/bench.json, bench.md and bench.png", highlight=False)
    if any(row.error for row in rows):
        raise click.exceptions.Exit(1)


def _bench_table(rows: list[CellResult], preset: str, wide: bool) -> Table:
    """Nine columns by default (80 columns wide), every one with --wide."""
    columns = ["engine", "model", "tokens", "page", "TP", "GB/s", "raw", "ratio", "p50 ms"]
    if wide:
        columns[-1:-1] = ["req"]
        columns[5:5] = ["path"]
        columns += ["p99 ms", "desc/req", "plan ms/req", "ctrl CPU ms/req"]
    table = Table(
        title=f"kvbridge bench ({preset})",
        title_justify="left",
        padding=(0, 1),
        caption="GB/s: 10^9 B/s. raw: the engine alone on the same blocks. ratio: kvbridge / raw.",
        caption_justify="left",
    )
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("engine", "model") else "right",
            no_wrap=column not in ("engine", "model"),
        )
    for row in rows:
        cell = row.cell
        values = {
            "engine": cell.engine,
            "model": cell.model,
            "tokens": str(cell.tokens),
            "page": str(cell.page_size),
            "TP": f"{cell.prefill_tp}→{cell.decode_tp}",
        }
        if row.skipped or row.error:  # the reason goes below the table, in full
            mark = "[yellow]skipped[/yellow]" if row.skipped else "[red]failed[/red]"
            table.add_row(*[values.get(column, "") for column in columns[:5]], mark)
            continue
        # The paths its chunks took (`chunks`: by "path (reason)"), most used first.
        paths: Counter[str] = Counter()
        for key, count in row.chunks.items():
            paths[key.split(" ")[0]] += count
        values |= {
            "path": "+".join(path for path, _ in paths.most_common()) or "-",
            "req": str(row.requests),
            "GB/s": f"{row.kvbridge_gbps:.2f}",
            "raw": f"{row.raw_gbps:.2f}",
            "ratio": f"{row.ratio:.2f}" if row.ratio is not None else "-",
            "p50 ms": f"{row.p50_ms:.0f}",
            "p99 ms": f"{row.p99_ms:.0f}",
            "desc/req": f"{row.descriptors_per_request:g}",
            "plan ms/req": f"{row.plan_ms_per_request:.3f}",
            "ctrl CPU ms/req": f"{row.control_cpu_ms_per_request:.2f}",
        }
        table.add_row(*[values[column] for column in columns])
    return table


@app.command("bootstrap")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=_validate_host,
    help="Address to bind (0.0.0.0: every interface; then set a secret).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8998,
    show_default=True,
    help="TCP port to serve on (0: any free port, printed at start).",
)
def bootstrap_command(host: str, port: int) -> None:
    """Run the bootstrap (rendezvous) service standalone until interrupted (SIGINT or
    SIGTERM: exit status 0). Prefill ranks register with it, decode ranks look them up.

    \b
    Example:
      kvbridge bootstrap --host 0.0.0.0 --port 8998
    """
    server = BootstrapServer(host, port, secret=secret_from_env())
    console.print(f"kvbridge bootstrap on {server.url}", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt as exc:  # the way to stop it: a clean exit, status 0
        received = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        console.print(f"{received}: bootstrap service stopped", highlight=False)
    finally:
        server.close()
