"""`epibus mcp` as MCP clients reach it: the official SDK's client starting `epibus mcp` over stdio (and once over
streamable HTTP) against a real `epibus up` node, each server acting as one agent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from bus.host.ports import free_ports
from bus.identity.signing import AgentKey
from observers.journal import EventQuery, Journal
from observers.reads import audit_artifacts
from tests.e2e.test_mesh_processes import git_repo
from tests.support import cli_env, eventually, last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow


def own_env(home: Path) -> dict[str, str]:
    return cli_env(home)


def epibus(home: Path, *args: str) -> Any:
    return last_json(run_epibus(home, *args, "--json"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("mcp") / "home"
    process, status = start_node_process(home)
    assert status["status"] == "running"
    try:
        yield home
    finally:
        stop_node_process(process)


@pytest.fixture
def project() -> str:
    return f"m-{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def agent(home: Path, name: str) -> AsyncIterator[Client]:
    """An MCP client session with `epibus mcp --agent NAME`, started as the client configuration says."""
    printed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "epibus", "mcp", "--print-config", "--agent", name],
        env=own_env(home),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    config = json.loads(printed.stdout)
    entry = config["mcpServers"][f"epibus-{name}"]
    params = StdioServerParameters(
        command=entry["command"], args=entry["args"], env=own_env(home) | entry.get("env", {})
    )
    async with Client(params, read_timeout_seconds=60) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool} failed: {result.content[0].text}"  # type: ignore[union-attr]
    data: dict[str, Any] = json.loads(result.content[0].text)  # type: ignore[union-attr]
    assert data == result.structured_content
    return data


async def refused(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool} was not refused: {result.content}"
    text: str = result.content[0].text  # type: ignore[union-attr]
    assert "\n" not in text
    return text


def node_journal(home: Path) -> Journal:
    return Journal(f"sqlite:///{home / 'journal.db'}")


def event_ids(home: Path, project: str) -> list[str]:
    store = node_journal(home)
    try:
        return [str(row.event_id) for row in store.query(EventQuery(project=project, limit=10_000))]
    finally:
        store.close()


def finding(project: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "project": project,
        "text": text,
        "impact": 0.6,
        "confidence": 0.7,
        "subject": "cache",
        "source": "search",
        "wait": "journaled",
    } | extra


def strings_without_bounds(schema: Any, path: str = "") -> list[str]:
    """Every string in a schema that accepts any length: what the guard could not keep small."""
    if isinstance(schema, list):
        return [p for i, s in enumerate(schema) for p in strings_without_bounds(s, f"{path}[{i}]")]
    if not isinstance(schema, dict):
        return []
    found = []
    if schema.get("type") == "string" and not ({"maxLength", "pattern", "enum", "const"} & set(schema)):
        found.append(path)
    for key, value in schema.items():
        found += strings_without_bounds(value, f"{path}.{key}")
    return found


async def test_the_tools_carry_schemas_with_the_vocabularies_as_explained_enums(node: Path) -> None:
    async with agent(node, "alice") as alice:
        tools = {tool.name: tool for tool in (await alice.list_tools()).tools}
    kinds = {"finding", "unknown", "mistake", "decision", "assumption", "dead_end"}
    assert {f"publish_{kind}" for kind in kinds} <= set(tools)
    assert {"recall", "audit_recall", "artifacts", "audit", "briefing", "events"} <= set(tools)
    assert {"verify", "contradict", "resolve", "rollback"} <= set(tools)
    assert {"propose", "inbox", "start", "complete", "acknowledge", "pending"} <= set(tools)
    decision = tools["publish_decision"].input_schema
    assert decision["additionalProperties"] is False
    reversibility = decision["properties"]["reversibility"]
    assert reversibility["enum"] == ["exploratory", "committal", "forced"]
    assert "exploratory: " in reversibility["description"]
    assert "forced: " in reversibility["description"]
    source = decision["properties"]["source"]["anyOf"][0]
    assert source["enum"] == ["intuition", "search", "mixed"]
    assert "intuition: no retrieval since the goal opened" in source["description"]
    resolution = tools["resolve"].input_schema["properties"]["resolution"]
    assert set(resolution["enum"]) == {"stale", "superseded", "retracted", "mistyped"}
    assert "retracted: " in resolution["description"]
    assert "verifier" not in tools["verify"].input_schema["properties"]  # the verifier is who signs, no argument
    for name, tool in tools.items():
        assert tool.input_schema["additionalProperties"] is False, name
        assert strings_without_bounds(tool.input_schema) == [], name


async def test_a_published_claim_is_recalled_and_its_author_may_not_verify_it(node: Path, project: str) -> None:
    async with agent(node, "alice") as alice:
        published = await call(alice, "publish_finding", **finding(project, "the build cache is cold after deploys"))
        assert published["level"] == "journaled"
        artifact = published["artifact_id"]

        async def recalled() -> dict[str, Any] | None:
            answer = await call(alice, "recall", project=project, query="why is the build slow after a release")
            return next((hit for hit in answer["hits"] if hit["artifact_id"] == artifact), None)

        hit = await eventually(recalled, timeout_s=60)
        assert hit is not None
        assert hit["content"] == "the build cache is cold after deploys"

        before = event_ids(node, project)
        message = await refused(alice, "verify", project=project, artifact_id=artifact, note="I checked it myself")
        assert message.startswith(("IllegalTransition: ", "Forbidden: ")), message
        assert "alice" in message
    assert event_ids(node, project) == before
    (view,) = [v for v in audit_artifacts(node_journal(node), project) if v.state.artifact_id == artifact]
    assert view.state.trust.value == "unverified"
    assert view.verifications == ()


async def test_another_agents_server_verifies_the_claim_as_that_agent(node: Path, project: str) -> None:
    async with agent(node, "alice") as alice:
        artifact = (await call(alice, "publish_finding", **finding(project, "p99 doubles on a cold cache")))[
            "artifact_id"
        ]
    async with agent(node, "bob") as bob:
        assert (await call(bob, "whoami"))["agent"] == "bob"
        await call(bob, "verify", project=project, artifact_id=artifact, note="reproduced on staging")

        async def verified() -> Any:
            views = [v for v in audit_artifacts(node_journal(node), project) if v.state.artifact_id == artifact]
            return views[0] if views and views[0].verifications else None

        view = await eventually(verified, timeout_s=20)
        listed = await call(bob, "artifacts", project=project)
        revision = await call(
            bob, "publish_finding", **finding(project, "p99 triples on a cold cache", revises=artifact)
        )
        chain = await call(bob, "lineage", project=project, artifact_id=revision["artifact_id"])
        first = await call(bob, "artifacts", project=project, limit=1)
        assert len(first["artifacts"]) == 1
        assert first["truncated"] is True
        assert listed["truncated"] is False
    assert view.state.trust.value == "verified"
    assert [(v.verifier, v.note, v.human_review) for v in view.verifications] == [
        ("bob", "reproduced on staging", False)
    ]
    assert [a["trust"] for a in listed["artifacts"] if a["artifact_id"] == artifact] == ["verified"]
    assert [(a["artifact_id"], a["trust"]) for a in chain["ancestors"]] == [(artifact, "verified")]
    assert chain["artifact"]["revises"] == artifact


async def test_an_undeclared_wrong_or_oversized_argument_is_refused_and_nothing_is_written(
    node: Path, project: str
) -> None:
    async with agent(node, "alice") as alice:
        artifact = (await call(alice, "publish_finding", **finding(project, "the disk fills at 03:00")))["artifact_id"]
    before = event_ids(node, project)
    async with agent(node, "bob") as bob:
        message = await refused(bob, "verify", project=project, artifact_id=artifact, verifier="manual")
        assert message.startswith("InvalidEvent: verify.verifier: is not an argument of verify"), message
        message = await refused(bob, "publish_finding", **finding(project, "x", human_review=True))
        assert "publish_finding.human_review" in message
        message = await refused(bob, "publish_finding", **finding(project, "impact as text") | {"impact": "0.5"})
        assert "publish_finding.impact='0.5'" in message
        message = await refused(bob, "publish_finding", **finding(project, "t" * 16_001))
        assert "publish_finding.text=" in message
        assert "16000" in message
        message = await refused(
            bob, "publish_decision", project=project, choice="c", rationale="r", confidence=0.5, reversibility="maybe"
        )
        assert "reversibility='maybe'" in message
        assert "exploratory" in message
        message = await refused(bob, "complete", task_id="t1", sha="a" * 40, repo="relative/repo")
        assert "complete.repo='relative/repo'" in message
        message = await refused(bob, "events", project=project, kind="findng")
        assert message.startswith("InvalidEvent: kind: 'findng' (did you mean 'finding'?) not in {"), message
        with pytest.raises(MCPError, match="unknown tool 'publish'"):
            await bob.call_tool("publish", {"project": project})
        # still serving after every refusal
        assert (await call(bob, "whoami"))["agent"] == "bob"
    assert event_ids(node, project) == before


async def test_the_audit_door_is_refused_to_an_agent_without_the_reviewer_role(node: Path, project: str) -> None:
    async with agent(node, "alice") as alice:
        await call(
            alice,
            "publish_unknown",
            project=project,
            question="does warming delay readiness?",
            impact=0.4,
            wait="journaled",  # the briefing below reads the journal
        )
        message = await refused(alice, "audit", project=project)
        assert message.startswith("Forbidden: agent 'alice' may not read through audit"), message
        message = await refused(alice, "audit_recall", project=project, query="readiness")
        assert message.startswith("Forbidden: "), message
        brief = await call(alice, "briefing", project=project)
    assert [u["content"] for u in brief["open_unknowns"]] == ["does warming delay readiness?"]


async def test_a_mesh_handshake_runs_entirely_through_mcp_servers(node: Path, project: str, tmp_path: Path) -> None:
    epibus(node, "mesh", "coordinators", "add", "coord", "-p", project)
    sha = git_repo(tmp_path / "repo")
    async with agent(node, "alice") as alice, agent(node, "bob") as bob, agent(node, "coord") as coord:
        proposed = await call(
            alice, "propose", project=project, title="rotate the web logs", summary="nginx logs fill /var", to=["bob"]
        )
        task = proposed["task_id"]
        inbox = await call(coord, "inbox", project=project)
        assert [t["task_id"] for t in inbox["tasks"]] == [task]
        await call(coord, "accept", task_id=task, assignee="bob")
        assert [t["why"] for t in (await call(bob, "inbox", project=project))["tasks"]] == ["assigned to you: start it"]
        message = await refused(bob, "acknowledge", task_id=task)
        assert message.startswith(("IllegalTransition: ", "Forbidden: ")), message
        await call(bob, "start", task_id=task)
        message = await refused(bob, "complete", task_id=task, sha="0" * 40, repo=str(tmp_path / "repo"))
        assert "0000000000" in message
        await call(bob, "complete", task_id=task, sha=sha, repo=str(tmp_path / "repo"), note="weekly now")
        assert [t["task_id"] for t in (await call(alice, "pending", project=project))["tasks"]] == [task]
        await call(alice, "acknowledge", task_id=task)
        assert (await call(alice, "pending", project=project))["tasks"] == []
    shown = epibus(node, "mesh", "show", task)
    assert shown["state"] == "acknowledged"
    assert shown["completion"]["sha"] == sha
    assert [(s["action"], s["actor"]) for s in shown["steps"]] == [
        ("propose", "alice"),
        ("accept", "coord"),
        ("start", "bob"),
        ("complete", "bob"),
        ("acknowledge", "alice"),
    ]


def free_port() -> int:
    return free_ports(1)[0]


async def test_the_http_server_serves_the_tools_to_a_client_holding_its_token(node: Path, project: str) -> None:
    port = free_port()
    config = epibus(node, "mcp", "--http", "--port", str(port), "--agent", "carol", "--print-config")
    entry = config["mcpServers"]["epibus-carol"]
    assert entry["url"] == f"http://127.0.0.1:{port}/mcp"
    server = subprocess.Popen(  # noqa: ASYNC220 (starting it does not wait for it)
        [sys.executable, "-m", "epibus", "mcp", "--http", "--port", str(port), "--agent", "carol", "--json"],
        env=own_env(node),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        assert json.loads(server.stdout.readline())["url"] == entry["url"]
        async with httpx2.AsyncClient() as anonymous:
            answer = await eventually(lambda: _post(anonymous, entry["url"]), timeout_s=20)
        assert answer.status_code == 401
        async with (
            httpx2.AsyncClient(headers=entry["headers"], timeout=60) as http,
            Client(streamable_http_client(entry["url"], http_client=http)) as carol,
        ):
            assert (await call(carol, "whoami"))["agent"] == "carol"
            published = await call(
                carol,
                "publish_dead_end",
                project=project,
                approach="warm the cache with curl",
                why_failed="the CDN ignores it",
                wait="journaled",
            )
        assert published["event_id"] in event_ids(node, project)
    finally:
        server.terminate()
        server.wait(timeout=30)


async def _post(client: httpx2.AsyncClient, url: str) -> httpx2.Response | None:
    try:
        return await client.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    except httpx2.ConnectError:
        return None


async def test_a_server_started_before_its_node_says_so_then_serves_once_the_node_is_up(tmp_path: Path) -> None:
    home = tmp_path / "home"
    project = f"m-{uuid.uuid4().hex[:10]}"
    async with agent(home, "dora") as dora:
        message = await refused(dora, "publish_unknown", project=project, question="is the node up?", impact=0.2)
        assert message.startswith("ConfigError: nats: no epibus node is running under"), message
        process, _ = await asyncio.to_thread(start_node_process, home)
        try:
            published = await call(
                dora, "publish_unknown", project=project, question="is the node up?", impact=0.2, wait="journaled"
            )
            assert published["event_id"] in event_ids(home, project)
            # the node restarts (same ports, kept): the server's connection follows it
            await asyncio.to_thread(stop_node_process, process)
            process, _ = await asyncio.to_thread(start_node_process, home)
            again = await call(
                dora, "publish_unknown", project=project, question="and after a restart?", impact=0.2, wait="journaled"
            )
            assert again["event_id"] in event_ids(home, project)
        finally:
            await asyncio.to_thread(stop_node_process, process)


async def test_a_person_reviews_at_the_cli_and_an_admin_reads_it_through_mcp_as_a_persons_review(
    node: Path, project: str
) -> None:
    passphrase = "the reviewer's own words\n"
    run_epibus(node, "person", "add", "rita", "-p", project, "--passphrase-stdin", stdin_text=passphrase)
    root = AgentKey.load_or_create(node, "root")
    epibus(node, "agent", "add", "root", "--key", root.public_key, "-p", project, "--role", "admin")
    async with agent(node, "alice") as alice:
        artifact = (await call(alice, "publish_finding", **finding(project, "the queue drops under load")))[
            "artifact_id"
        ]
        await call(alice, "whoami")
    # The person reviews with the CLI and their passphrase; no MCP server runs as them.
    await asyncio.to_thread(
        run_epibus, node, "verify", artifact, "-p", project, "--person", "rita", "--passphrase-stdin",
        "--note", "read the load test myself", stdin_text=passphrase,
    )  # fmt: skip
    async with agent(node, "root") as admin:
        me = await call(admin, "whoami")
        assert me["enrolment"]["roles"] == ["admin"]
        audited = await eventually(lambda: _verified_in_audit(admin, project, artifact), timeout_s=20)
        message = await refused(admin, "artifacts", project=f"{project}-other")
        assert message.startswith(f"Forbidden: agent 'root' may not read project {project}-other"), message
        # an admin moves root to another project: the running server stops reading this one
        moved = f"{project}-x"
        await asyncio.to_thread(
            epibus, node, "agent", "add", "root", "--key", root.public_key, "-p", moved, "--role", "admin"
        )
        message = await eventually(lambda: _refused_or_none(admin, "artifacts", project=project), timeout_s=20)
        assert message.startswith(f"Forbidden: agent 'root' may not read project {project}"), message
    assert [(v["verifier"], v["human_review"]) for v in audited["verifications"]] == [("rita", True)]
    assert (audited["vouched"]["agents"], audited["vouched"]["people"], audited["vouched"]["last_person"]) == (
        0,
        1,
        "rita",
    )


async def _refused_or_none(client: Client, tool: str, **arguments: Any) -> str | None:
    result = await client.call_tool(tool, arguments)
    return result.content[0].text if result.is_error else None  # type: ignore[union-attr]


async def _verified_in_audit(client: Client, project: str, artifact: str) -> dict[str, Any] | None:
    listed = await call(client, "audit", project=project)
    found = [a for a in listed["artifacts"] if a["artifact_id"] == artifact and a["verifications"]]
    return found[0] if found else None


async def test_a_watch_registered_through_mcp_pushes_a_claim_another_agent_publishes(node: Path, project: str) -> None:
    async with agent(node, "alice") as alice, agent(node, "bob") as bob:
        made = (await call(alice, "watch", about="deploys leave the cache empty", projects=[project]))["watch"]
        assert [w["watch_id"] for w in (await call(alice, "watches"))["watches"]] == [made["watch_id"]]
        first = await call(alice, "notices", after_seq=0, wait_s=0)
        assert first["notices"] == []  # nothing yet, and said so at once
        published = await call(bob, "publish_finding", **finding(project, "the build cache is cold after deploys"))
        await call(bob, "publish_finding", **finding(project, "bananas are yellow when ripe"))

        async def told() -> dict[str, Any] | None:
            answer = await call(alice, "notices", after_seq=first["next_after_seq"], wait_s=5)
            return answer if answer["notices"] else None

        answer = await eventually(told, timeout_s=60)
        assert [(n["notice"], n["artifact_id"], n["author"]) for n in answer["notices"]] == [
            ("match", published["artifact_id"], "bob")
        ]
        later = await call(alice, "notices", after_seq=answer["next_after_seq"], wait_s=1)
        assert later["notices"] == []  # the unrelated claim was not pushed, the match not twice
        assert (await call(alice, "stop_watch", watch_id=made["watch_id"]))["stopped"] is True
        assert "projects" in await refused(bob, "watch", about="x", projects=["Not A Slug"])
