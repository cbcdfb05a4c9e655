"""First contact, as a new user meets epibus: the README's tour runs top to bottom as written on a fresh node,
at 80 columns; a new agent's first publish is quiet; a mistyped project gets a hint; an unknown id is NotFound
whether typed whole or as a prefix; the NATS tools' conventions (NATS_URL, a .creds file, a `nats` context)
work. One node process for the module, as a user would have it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest

from bus.identity.signing import AgentKey
from tests.support import cli_env, last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
README = Path(__file__).parents[2] / "README.md"


def tour_script() -> str:
    """The first bash block under the README's tour heading, exactly as written."""
    text = README.read_text()
    section = text[text.index("## Five-minute tour") :]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found is not None, "the README's tour has no bash block"
    return found.group(1)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    home = tmp_path_factory.mktemp("first-contact") / "home"
    process, status = start_node_process(home)
    try:
        yield home, status
    finally:
        stop_node_process(process)


def test_the_readme_tour_runs_as_written_on_a_fresh_node(node: tuple[Path, dict[str, Any]]) -> None:
    home, _ = node
    env = cli_env(home, columns=80) | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-x", "-c", tour_script()],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=home.parent,
    )
    ran = [line for line in result.stderr.splitlines() if re.match(r"\++ epibus ", line)]  # ++: inside $(…)
    assert result.returncode == 0, f"stopped after {ran[-1:]}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    out = result.stdout
    for word in ("5 artifact(s) in demo", "recall: 5 hit(s)", "top artifacts", "contradicted", "rolled back 1",
                 "resolved (stale)", "lineage of", "audit of demo", "every store", "acknowledge", "reconcile",
                 "epibus doctor"):  # fmt: skip
        assert word in out, (word, out[-3000:])
    assert len(ran) == tour_script().count("epibus ") - tour_script().count("`epibus ")
    tables = [line for line in out.splitlines() if "─" in line]
    assert tables
    assert max(len(line) for line in tables) <= 80


def test_a_new_agents_first_publish_is_quiet(node: tuple[Path, dict[str, Any]]) -> None:
    home, _ = node
    first = run_epibus(home, "publish", "finding", "-p", "quiet", "-q", "--text", "carol's first claim",
                       "--impact", "0.3", "--confidence", "0.5", "--subject", "s", "--agent", "carol")  # fmt: skip
    assert first.stderr == ""
    assert re.fullmatch(r"[0-9a-f-]{36}\n", first.stdout)


def test_a_mistyped_project_is_empty_with_a_hint_and_a_new_one_without(node: tuple[Path, dict[str, Any]]) -> None:
    home, _ = node
    run_epibus(home, "publish", "finding", "-p", "hinted", "--text", "t", "--impact", "0.3", "--confidence", "0.5",
               "--subject", "s", "--wait", "journaled")  # fmt: skip
    near = run_epibus(home, "artifacts", "-p", "hintd")
    assert "did you mean 'hinted'?" in near.stderr
    assert "0 artifact(s) in hintd" in near.stdout
    as_json = run_epibus(home, "artifacts", "-p", "hintd", "--json")
    assert (json.loads(as_json.stdout), as_json.stderr) == ([], "")  # scripts get the answer only


def test_an_unknown_artifact_is_not_found_whole_or_as_a_prefix(node: tuple[Path, dict[str, Any]]) -> None:
    home, _ = node
    for given in ("01a24cd8-f037-72c4-a4af-036fe415f8f9", "01a24cd8f037"):
        refused = run_epibus(home, "verify", given, "-p", "demo", "--agent", "bob", "--json", check=False)
        assert refused.returncode == 1
        assert json.loads(refused.stderr)["type"] == "NotFound", refused.stderr


def test_nats_url_is_honoured(node: tuple[Path, dict[str, Any]]) -> None:
    home, status = node
    env = cli_env(home) | {"NATS_URL": "nats://127.0.0.1:1"}
    dead = subprocess.run([sys.executable, "-m", "epibus", "stats", "--json"], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert dead.returncode == 1
    assert "127.0.0.1:1" in json.loads(dead.stderr)["error"]
    env["NATS_URL"] = status["nats_url"]
    live = subprocess.run([sys.executable, "-m", "epibus", "stats", "--json"], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
    assert live.returncode == 0, live.stderr
    assert last_json(live)["streams"]["EPI"]["messages"] > 0


def test_a_creds_file_is_the_agents_identity(node: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    home, _ = node
    key = AgentKey.generate("dave")
    seed = nkeys.from_seed(key.nats_credentials["nkeys_seed_str"].encode()).seed.decode()
    creds = tmp_path / "dave.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\neyJhbGciOi.unused.here\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    env = cli_env(home) | {"NATS_CREDS": str(creds)}
    published = subprocess.run(
        [sys.executable, "-m", "epibus", "publish", "finding", "-p", "creds", "--text", "signed with a creds file",
         "--impact", "0.3", "--confidence", "0.5", "--subject", "s", "--agent", "dave", "--json"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert published.returncode == 0, published.stderr
    assert not (home / "keys" / "dave.nk").exists()  # no key of its own was made
    agents = json.loads(run_epibus(home, "agent", "list", "--json").stdout)
    (dave,) = [a for a in agents if a["agent_id"] == "dave"]
    assert dave["public_key"] == key.public_key


def test_a_nats_context_logs_in_as_the_agent_and_as_the_operator(
    node: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    home, _ = node
    env = cli_env(home) | {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    for args in ((), ("--as-node",)):
        saved = subprocess.run(
            [sys.executable, "-m", "epibus", "nats-context", "--save", *args, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert saved.returncode == 0, saved.stderr
        path = Path(last_json(saved)["path"])
        assert path.stat().st_mode & 0o777 == 0o600
        context = json.loads(path.read_text())
        seed = Path(context["nkey"]).read_text().strip()
        assert asyncio.run(_connect_as_the_nats_cli_would(context, seed)) > 0


async def _connect_as_the_nats_cli_would(context: dict[str, Any], seed: str) -> int:
    """url, the nkey seed (from the context's file) and the inbox prefix, as `nats --context` reads them; the
    operator then reads the stream's size; an agent's connection is let in."""
    prefix = context.get("inbox_prefix")
    nc = await nats.connect(
        context["url"], nkeys_seed_str=seed, **({"inbox_prefix": prefix.encode()} if prefix else {})
    )
    try:
        if prefix is None:
            return (await nc.jetstream().stream_info("EPI")).state.messages
        await nc.flush()
        return 1 if nc.is_connected else 0
    finally:
        await nc.close()


# -- the light install ------------------------------------------------------------------------------------

LIGHT_SITE = '''
import importlib.abc, sys
from epibus.extras import EXTRA_OF_MODULE

class LightInstall(importlib.abc.MetaPathFinder):
    """Only what `pip install epibus` installs can be imported: every extra's module is missing."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRA_OF_MODULE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, LightInstall())
'''

CONSUME = """
import asyncio, sys
from epibus import connect

async def main():
    async with connect(agent="dora") as client, client.consume(sys.argv[1], from_start=True) as events:
        received = await asyncio.wait_for(anext(events), 15)
        received.ack()
        print(received.event.event_id)

asyncio.run(main())
"""


def light(home: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A command as it runs on the light install: the extras' modules cannot be imported."""
    site = tmp_path / "light-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(LIGHT_SITE)
    env = cli_env(home, columns=100) | {"PYTHONPATH": f"{site}:{Path(__file__).parents[2]}"}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def test_an_agent_on_the_light_install_publishes_reads_recalls_tails_and_consumes(
    node: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    home, _ = node
    probe = light(home, tmp_path, "-c", "import fastembed")
    assert "No module named 'fastembed'" in probe.stderr  # the light install is what this test runs
    published = light(home, tmp_path, "-m", "epibus", "publish", "finding", "-p", "light", "-q", "--agent", "dora",
                      "--text", "a light client publishes", "--impact", "0.3", "--confidence", "0.5",
                      "--subject", "s", "--wait", "indexed")  # fmt: skip
    assert published.returncode == 0, published.stderr
    event_id = published.stdout.strip()
    for args, word in (
        (["artifacts", "-p", "light", "--agent", "dora"], "1 artifact(s) in light"),
        (["recall", "what does a light client do", "-p", "light", "--agent", "dora"], "a light client"),
        (["tail", "-p", "light", "-n", "1", "--from-start", "--agent", "dora"], event_id),
    ):
        result = light(home, tmp_path, "-m", "epibus", *args)
        if result.returncode != 0:
            pytest.fail(f"{args} failed:\n{result.stderr}")  # the whole message: an assertion's repr is cut
        assert word in result.stdout, (args, result.stdout)
    consumed = light(home, tmp_path, "-c", CONSUME, "light")
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.strip() == event_id


def test_a_node_command_on_the_light_install_names_the_extra_to_install(tmp_path: Path) -> None:
    result = light(tmp_path / "home", tmp_path, "-m", "epibus", "up")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install 'epibus[node]'" in result.stderr


def test_the_light_install_holds_nothing_of_the_node_extra() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[\[<>=]", requirement)[0] for requirement in project["dependencies"]}
    node_extra = {re.split(r"[\[<>=]", requirement)[0] for requirement in project["optional-dependencies"]["node"]}
    assert core & node_extra == set()
    assert {"fastembed", "qdrant-edge-py", "onnxruntime"} & core == set()
