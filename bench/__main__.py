"""`python -m bench`: every row of the performance issue side by side, each against a fresh nats-server, each
epibus figure next to a baseline measured in the same run; prints a table and writes bench/results.json.

    python -m bench [--quick | --full] [--only ROW ...] [--json | --markdown] [--out PATH]
    python -m bench --from bench/results.json   # an earlier run as the README's markdown table

Rows: live (publish -> journaled vs a FastStream pipeline; needs the `bench` extra), drain, publish, mirror,
recall (with a million-point row in --full), state, mesh, catch-up, watch. A row that fails is reported as
failed (with its error) and the exit code is 1."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType

from rich.console import Console

from bench.harness import SERVER_SYNC, SIZES, Line, failed, machine, markdown, results, scratch, table
from bench.rows import ROWS

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every row's `finally` stops its nats-server (they run in sessions of
    # their own and would outlive us otherwise).
    raise KeyboardInterrupt(f"signal {signum}")


async def run(names: list[str], mode: str, console: Console) -> list[Line]:
    lines: list[Line] = []
    for name in names:
        console.print(f"[bold]{name}[/bold] …", end=" ")
        start = time.perf_counter()
        with scratch() as root:
            try:
                got = await ROWS[name](root, SIZES[mode])
            except (Exception, ExceptionGroup) as error:  # noqa: BLE001 - reported in the table and the exit code
                traceback.print_exc(file=sys.stderr)
                got = [failed(name, error)]
        console.print(f"{time.perf_counter() - start:.1f} s")
        lines += got
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (the whole run takes a few minutes)")
    size.add_argument("--full", action="store_true", help="20k events, 100k and 1M points (about 35 minutes)")
    size.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the smoke test's size
    size.add_argument(
        "--scale", action="store_true", help="a million events through one `epibus up` node (about 40 minutes)"
    )
    parser.add_argument("--scale-events", type=int, default=1_000_000, help="events for --scale")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(ROWS),
        metavar="ROW",
        help=f"run only this row (repeatable): {', '.join(ROWS)}",
    )
    parser.add_argument(
        "--sync", choices=["default", "always"], default="default", help="the servers' sync (default: the server's)"
    )
    parser.add_argument("--json", action="store_true", help="print results.json to stdout instead of the table")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown (the README's)")
    parser.add_argument("--from", dest="source", type=Path, help="render an earlier results.json; run nothing")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the results")
    args = parser.parse_args()
    if args.source is not None:
        earlier = json.loads(args.source.read_text())
        print(markdown([Line(**row) for row in earlier["rows"]], earlier["machine"], earlier["mode"]), end="")
        return
    if args.scale:
        run_scale_bench(args.scale_events, args.out, as_markdown=args.markdown)
        return
    mode = "full" if args.full else "tiny" if args.tiny else "quick"
    names = [name for name in ROWS if not args.only or name in args.only]
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 160)
    SERVER_SYNC["mode"] = args.sync
    info = machine()
    started = time.perf_counter()
    lines = asyncio.run(run(names, mode, console))
    report = results(mode, started, info, lines)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.markdown:
        print(markdown(lines, info, mode), end="")
    else:
        load = " ".join(f"{x:.2f}" for x in info["load_average"])
        console.print(
            table(
                lines,
                f"epibus vs baselines, {mode} ({info['cpu_count']} CPUs, load {load} at start, "
                f"{info['nats_server']}, Python {info['python']})",
            )
        )
        console.print(f"written to {args.out}")
    sys.exit(1 if any(line.error is not None for line in lines) else 0)


def run_scale_bench(events: int, out: Path, *, as_markdown: bool) -> None:
    from rich.table import Table

    from bench.scale import run_scale, scale_markdown, scale_rows

    console = Console(width=None if sys.stdout.isatty() else 160)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    info = machine()
    started = time.perf_counter()
    with scratch() as root:
        report = asyncio.run(run_scale(root, events, lambda what: console.print(f"[bold]scale[/bold] {what}")))
    report["wall_s"] = round(time.perf_counter() - started)
    target = out if out != DEFAULT_OUT else out.with_name("scale.json")
    target.write_text(json.dumps({"machine": info, "scale": report}, indent=2, default=str) + "\n")
    if as_markdown:
        print(scale_markdown(report), end="")
        return
    table_ = Table(title=f"epibus at scale ({info['cpu_count']} CPUs, {report['wall_s']} s)")
    for column in ("figure", "value", "target", "met"):
        table_.add_column(column, overflow="fold")
    for figure, value, goal, met in scale_rows(report):
        table_.add_row(figure, value, goal, "" if met is None else "yes" if met else "no")
    console.print(table_)
    console.print(f"written to {target}")


if __name__ == "__main__":
    main()
