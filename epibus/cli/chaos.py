"""`epibus chaos`: the audit an operator runs to learn what a failure costs: a workload under real faults,
then every store read back. Exit code 1 when an acknowledged event was lost, duplicated or changed."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from bus.host.home import epibus_home, private_dir
from epibus.chaos.faults import CLUSTER_ONLY, FAULTS, parse_faults
from epibus.cli.common import HomeOpt, JsonOpt, console, emit_json, err_console, handles_errors, run, table
from epibus.cli.display import shown

if TYPE_CHECKING:  # the run loads the journal's and the mirror's libraries: only a chaos run needs them
    from epibus.chaos.run import ChaosReport

T = TypeVar("T")
FAULTS_HELP = "; ".join(f"{name}: {text}" for name, text in FAULTS.items())
STORE_COLUMNS = ("store", "acked", "present", "lost", "duplicated", "unknown", "wrong", "error")
# An attached cluster's servers listen where `epibus cluster up` put them: on loopback, where nothing can be cut.
ATTACHED_ON_LOOPBACK = "the attached cluster's servers share the loopback network; run chaos without --attach"
FAULT_COLUMNS = ("fault", "target", "outcome", "at_s", "held_s", "recovered_s")


@handles_errors
def chaos(
    nodes: Annotated[
        int, typer.Option("--nodes", help="1: one node on its embedded server; 3 to 5: the one-machine cluster.")
    ] = 1,
    faults: Annotated[
        str, typer.Option("--faults", help=f"all, none, or a comma-separated list of: {FAULTS_HELP}.")
    ] = "all",
    rounds: Annotated[int, typer.Option("--rounds", min=1, max=1000, help="Run the faults this many times over.")] = 1,
    rate: Annotated[float, typer.Option("--rate", min=1.0, max=5000.0, help="Events per second, in all.")] = 80.0,
    publishers: Annotated[int, typer.Option("--publishers", min=1, max=32, help="Publishing agents.")] = 3,
    projects: Annotated[int, typer.Option("--projects", min=1, max=32, help="Projects they publish in.")] = 3,
    hold_s: Annotated[
        float, typer.Option("--hold-s", min=0.5, max=600.0, help="How long a pause, outage or partition lasts.")
    ] = 4.0,
    min_run_s: Annotated[
        float, typer.Option("--min-run-s", min=1.0, max=86_400.0, help="Publish at least this long.")
    ] = 10.0,
    min_events: Annotated[
        int,
        typer.Option("--min-events", min=0, max=10_000_000, help="Publish at least this many (with --min-run-s)."),
    ] = 0,
    max_events: Annotated[
        int, typer.Option("--max-events", min=1, max=10_000_000, help="Stop publishing after this many.")
    ] = 20_000,
    settle_s: Annotated[
        float, typer.Option("--settle-s", min=1.0, max=3600.0, help="Bound on the wait for the stores to catch up.")
    ] = 180.0,
    attach: Annotated[
        bool,
        typer.Option(
            "--attach", help="Break the cluster `epibus cluster up` runs under --home instead of starting nodes."
        ),
    ] = False,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Where the nodes, ledger and report go (default: <home>/chaos/<run>)."),
    ] = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Start NODES nodes with failpoints on, publish findings from several agents on several projects at RATE
    while the faults run one after another, let the outboxes drain and the observers catch up, then read back
    the stream on every server and every node's journal and mirror. Per store: acknowledged events present,
    lost, duplicated, unknown (present but never acknowledged: allowed) and wrong (other content). The nodes
    stop when the run ends; the ledger (attempts.jsonl) and report.json stay in the run directory."""
    from epibus.chaos.run import ChaosSettings, run_chaos

    chosen = parse_faults(faults)
    where = run_dir or epibus_home(home) / "chaos" / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    network, why_not = _namespaces(nodes, chosen) if not attach else (None, ATTACHED_ON_LOOPBACK)
    settings = ChaosSettings(
        run_dir=where, size=nodes, faults=chosen, rounds=rounds, publishers=publishers, projects=projects, rate=rate,
        max_events=max_events, hold_s=hold_s, min_run_s=min_run_s, min_events=min_events, settle_s=settle_s,
        network=network, network_unavailable=why_not, attach=epibus_home(home) if attach else None,
    )  # fmt: skip
    say_to = err_console if as_json else console
    private_dir(where)
    # The nodes' and clients' own logs (reconnects, warnings while a server is down) go to the run's log.
    root = logging.getLogger()
    kept_handlers = root.handlers[:]
    root.handlers = [logging.FileHandler(where / "chaos.log")]
    stopped: list[int] = []
    try:
        report = run(_until_stopped(run_chaos(settings, lambda line: say_to.log(shown(line))), stopped))
    except asyncio.CancelledError:
        if not stopped:
            raise
        raise typer.Exit(128 + stopped[0]) from None  # the nodes are stopped; what the run measured is moot
    finally:
        root.handlers = kept_handlers
        if network is not None:
            network.close()
    if as_json:
        emit_json(report.as_dict())
    else:
        _print(report)
    if not report.ok:
        raise typer.Exit(1)


async def _until_stopped(work: Coroutine[Any, Any, T], stopped: list[int]) -> T:
    """Run `work`; SIGTERM cancels it, so it unwinds at an await (nodes stopped, namespaces removed) like
    Ctrl-C. Never an exception raised from a signal handler: that lands at any line, even inside a lock."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def stop() -> None:
        stopped.append(signal.SIGTERM)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    try:
        return await work
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _namespaces(nodes: int, chosen: tuple[str, ...]) -> tuple[Any, str | None]:
    """Network namespaces for the partition fault, when it was chosen for a cluster and the machine allows them."""
    if "partition" not in chosen or nodes == 1:
        return None, None
    from epibus.cluster.netns import Namespaces, netns_unavailable

    reason = netns_unavailable()
    if reason is not None:
        return None, reason
    return Namespaces(nodes), None


def _print(report: ChaosReport) -> None:
    data = report.as_dict()
    rows = [[store[c] for c in STORE_COLUMNS] for store in data["stores"]]
    console.print(table("epibus chaos: every store read back", list(STORE_COLUMNS), rows))
    fault_rows = [[fault[c] for c in FAULT_COLUMNS] for fault in data["faults"]]
    console.print(table("faults", list(FAULT_COLUMNS), fault_rows))
    attempts = data["attempts"]
    console.print(
        shown(
            f"{attempts['total']} publish attempts: {attempts['published']} published, {attempts['outboxed']} "
            f"outboxed, {attempts['error']} refused; settled in {data['settled'].get('seconds')}s; run took "
            f"{data['seconds']}s; report: {Path(data['settings']['run_dir']) / 'report.json'}"
        )
    )
    skipped = [f for f in data["faults"] if f["outcome"] != "injected"]
    for fault in skipped:
        note = " (cluster only: --nodes 3)" if fault["fault"] in CLUSTER_ONLY and report.settings["nodes"] == 1 else ""
        console.print(shown((f"{fault['fault']}: ", "yellow"), f"{fault['outcome']}{note}"))
    verdict = ("ok: ", "bold green") if report.ok else ("FAILED: ", "bold red")
    said = "no acknowledged event lost, duplicated or changed"
    if not report.ok:
        said = "an acknowledged event was lost, duplicated or changed, a store could not be read, or a fault failed"
    console.print(shown(verdict, said))
