"""Starting the command line loads no heavy library a command may not need: the MCP SDK and its web stack, the
node's servers, SQLAlchemy, the mirror's embedding and vector stores, the metrics client, the mesh's agent.
Each command that needs one imports it when it runs. A structural check on `sys.modules`, never a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Top-level packages, and this project's modules that import them.
HEAVY = (
    "mcp",
    "mcp_types",
    "starlette",
    "sse_starlette",
    "uvicorn",
    "httpx",
    "httpx2",
    "opentelemetry",
    "sqlalchemy",
    "psycopg",
    "fastembed",
    "onnxruntime",
    "numpy",
    "qdrant_client",
    "qdrant_edge",
    "prometheus_client",
    "epibus.node.node",
    "epibus.dashboard",
    "epibus.mcp_tools",
    "epibus.monitoring.metrics",
    "observers.journal",
    "mesh.agent",
)


def loaded_heavy(argvs: list[list[str]], home: Path) -> tuple[list[object], list[str]]:
    """Run `epibus ARGV` for each ARGV, one after the other in one fresh interpreter, through the console entry
    point: their exit codes and the heavy modules they loaded between them."""
    code = (
        "import json, sys\n"
        "from epibus.cli import main\n"
        "codes = []\n"
        f"for argv in {argvs!r}:\n"
        "    sys.argv = ['epibus', *argv]\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit as e:\n"
        "        codes.append(e.code)\n"
        "    else:\n"
        "        codes.append(0)\n"
        f"heavy = {HEAVY!r}\n"
        "found = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy))\n"
        "print('\\nHEAVY ' + json.dumps({'codes': codes, 'heavy': found}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")}
    env |= {"PYTHONPATH": str(ROOT), "EPIBUS_HOME": str(home)}
    ran = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout.rsplit("\nHEAVY ", 1)[1])
    return report["codes"], report["heavy"]


def test_commands_that_do_not_need_them_load_none_of_the_heavy_libraries(tmp_path: Path) -> None:
    argvs = [["--help"], ["--version"], ["status", "--json"], ["events", "--help"], ["mcp", "--help"]]
    codes, heavy = loaded_heavy(argvs, tmp_path / "home")
    assert codes == [0, 0, 1, 0, 0]  # status exits 1: no node runs under this home
    assert heavy == []


def test_a_command_that_needs_one_loads_it_when_it_runs(tmp_path: Path) -> None:
    # The check above could pass on a list of names nothing imports: `events --journal` reads the journal, `mcp
    # --print-config --http` makes the HTTP server's token. A kind the mesh registers is known without its agent.
    argvs = [["events", "--journal", "node", "--kind", "task", "--json"], ["mcp", "--print-config", "--http"]]
    codes, heavy = loaded_heavy(argvs, tmp_path / "home")
    assert codes == [0, 0]
    assert {"sqlalchemy", "observers.journal", "mcp", "epibus.mcp_tools.server"} <= set(heavy)
