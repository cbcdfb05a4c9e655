"""A person's review through the CLI, as people and agents do it on one node: an admin makes a person (a key
encrypted with the passphrase they type), the person verifies with it, and the reads tell that review from an
agent's. A wrong passphrase writes nothing; the reviewer role is a person's only; no agent process runs as a
person."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.host.home import read_node_info
from bus.identity.person import unlock_person_key
from bus.identity.signing import AgentKey, node_key
from tests.support import cli_env, eventually_sync, last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
P = "reviews"
PASSPHRASE = "correct horse battery staple"


def epibus(home: Path, *args: str, stdin_text: str | None = None, check: bool = True) -> Any:
    return run_epibus(home, *args, stdin_text=stdin_text, check=check)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("reviews") / "home"
    process, _status = start_node_process(home)
    try:
        yield home
    finally:
        stop_node_process(process)


def test_a_person_reviews_with_their_passphrase_and_the_reads_tell_it_from_an_agents(node: Path) -> None:
    made = last_json(epibus(node, "person", "add", "dana", "-p", P, "--passphrase-stdin", "--json",
                            stdin_text=PASSPHRASE + "\n"))  # fmt: skip
    assert (made["identity"], made["roles"], made["projects"]) == ("person", ["reviewer"], [P])
    assert PASSPHRASE not in Path(made["key_file"]).read_text()
    claim = last_json(epibus(node, "publish", "finding", "-p", P, "--agent", "alice", "--text", "the cache is cold",
                             "--impact", "0.9", "--confidence", "0.7", "--subject", "s", "--wait", "journaled",
                             "--json"))["artifact_id"]  # fmt: skip
    epibus(node, "verify", claim, "-p", P, "--agent", "bob", "--note", "ran it", "--json")

    wrong = epibus(node, "verify", claim, "-p", P, "--person", "dana", "--passphrase-stdin",
                   stdin_text="not the passphrase\n", check=False)  # fmt: skip
    assert "passphrase: does not unlock dana's key" in one_line_error(wrong)
    no_terminal = epibus(node, "verify", claim, "-p", P, "--person", "dana", check=False)
    assert "no terminal to ask dana's passphrase on" in one_line_error(no_terminal)
    log = last_json(epibus(node, "audit", "-p", P, "--journal", "node", "--json"))[0]["verifications"]
    assert [(v["verifier"], v["human_review"]) for v in log] == [("bob", False)]  # nothing was written

    epibus(node, "verify", claim, "-p", P, "--person", "dana", "--passphrase-stdin", "--note", "read the trace",
           stdin_text=PASSPHRASE + "\n")  # fmt: skip

    def reviewed() -> list[tuple[str, bool]]:
        rows = last_json(epibus(node, "audit", "-p", P, "--journal", "node", "--json"))[0]["verifications"]
        return [(v["verifier"], v["human_review"]) for v in rows]

    assert reviewed() == [("bob", False), ("dana", True)]
    # Every read says who vouched: the journal's (artifacts, briefing) and the mirror's (recall), as JSON and
    # as the table a person reads.
    (listed,) = last_json(epibus(node, "artifacts", "-p", P, "--json"))
    vouched = listed["vouched"]
    assert (vouched["agents"], vouched["people"], vouched["last_person"]) == (1, 1, "dana")
    assert vouched["last_person_at"] is not None
    briefed = last_json(epibus(node, "briefing", "-p", P, "--json"))
    assert [a["vouched"] for a in briefed["top"] if a["artifact_id"] == claim] == [vouched]

    def recalled() -> dict[str, Any] | None:
        hits = last_json(epibus(node, "recall", "is the cache cold", "-p", P, "--json"))["hits"]
        return hits[0]["vouched"] if hits and hits[0]["vouched"]["people"] else None

    assert eventually_sync(recalled, timeout_s=20) == vouched
    table = run_epibus(node, "artifacts", "-p", P, columns=300).stdout.splitlines()
    header = next(line for line in table if "agents" in line)
    row = next(line for line in table if line.startswith(claim[:13]))
    assert [row.split()[header.split().index(c)] for c in ("agents", "people")] == ["1", "dana"]


def test_the_reviewer_role_is_a_persons_only(node: Path) -> None:
    rita = AgentKey.generate("rita")
    refused = epibus(node, "agent", "add", "rita", "--key", rita.public_key, "-p", P, "--role", "reviewer",
                     check=False)  # fmt: skip
    assert "rita is an agent identity and only a person may hold the reviewer role" in one_line_error(refused)
    listed = {a["agent_id"] for a in last_json(epibus(node, "agent", "list", "--json"))}
    assert "rita" not in listed
    as_agent = epibus(node, "person", "add", "erin", "-p", P, "--role", "agent", "--passphrase-stdin",
                      stdin_text=PASSPHRASE + "\n", check=False)  # fmt: skip
    assert "--role" in one_line_error(as_agent)
    # A person's identity never passes to an agent's key, not even as a key rotation.
    epibus(node, "person", "add", "hal", "-p", P, "--passphrase-stdin", stdin_text=PASSPHRASE + "\n")
    rotated = epibus(node, "agent", "add", "hal", "--key", rita.public_key, "-p", P, "--replace-key", check=False)
    assert "it is enrolled as person and this enrolment makes it agent" in one_line_error(rotated)


def test_no_agent_process_runs_as_a_person(node: Path, tmp_path: Path) -> None:
    epibus(node, "person", "add", "flo", "-p", P, "--passphrase-stdin", stdin_text=PASSPHRASE + "\n")
    published = epibus(node, "publish", "finding", "-p", P, "--agent", "flo", "--text", "x", "--impact", "0.1",
                       "--confidence", "0.1", "--subject", "s", check=False)  # fmt: skip
    assert "flo is a person's identity: it signs only at the CLI" in one_line_error(published)
    mcp = epibus(node, "mcp", "--agent", "flo", check=False)
    assert mcp.returncode != 0
    assert "flo is a person's identity" in mcp.stderr
    statusline = epibus(node, "statusline", "--agent", "flo", check=False)
    assert statusline.returncode == 1
    assert "flo is a person's identity" in statusline.stderr
    assert not (node / "keys" / "flo.nk").exists()
    # Even holding the person's key itself (unlocked, in a .creds file), an MCP server refuses at start.
    creds = tmp_path / "flo.creds"
    seed = unlock_person_key(node, "flo", PASSPHRASE).seed.decode()
    creds.write_text(f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
    info = read_node_info(node)
    assert info is not None
    server = subprocess.run(
        [sys.executable, "-m", "epibus", "mcp", "--agent", "flo", "--nats", info.nats_url],
        env=cli_env(tmp_path / "elsewhere") | {"NATS_CREDS": str(creds)},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert server.returncode == 1, server.stderr
    assert "may not run an MCP server as a person: flo is a person's identity" in server.stderr


def publish(home: Path, text: str, impact: str, project: str) -> str:
    out = epibus(home, "publish", "finding", "-p", project, "--agent", "alice", "--text", text, "--impact", impact,
                 "--confidence", "0.7", "--subject", "s", "--wait", "indexed", "--json")  # fmt: skip
    return str(last_json(out)["artifact_id"])


def safe_reads(home: Path, project: str) -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]]]:
    """What the safe door shows, in order, with each claim's review status: the journal's and the mirror's."""
    listed = last_json(epibus(home, "artifacts", "-p", project, "--json"))
    hits = last_json(epibus(home, "recall", "the deploy and the cache", "-p", project, "--json"))["hits"]
    return [(a["artifact_id"], a["review"]) for a in listed], [(h["artifact_id"], h["review"]) for h in hits]


def follow(home: Path, count: int) -> list[str]:
    """The next `count` notices of wendy's watches, as JSON lines (from where she last looked)."""
    out = epibus(home, "watch", "follow", "--count", str(count), "--agent", "wendy", "--json")
    return [line for line in out.stdout.splitlines() if line.startswith("{")]


def test_a_projects_review_policy_holds_its_weighty_claims_for_a_person(node: Path, tmp_path: Path) -> None:
    q = "weighty"
    epibus(node, "watch", "--about", "the deploy broke the cache", "-p", q, "--agent", "wendy", "--no-follow")
    set_policy = last_json(epibus(node, "policy", "set", "-p", q, "--human-review-impact", "0.8", "--json"))
    assert (set_policy["policy"]["human_review_impact"], set_policy["policy"]["mode"]) == (0.8, "rank")
    small = publish(node, "the deploy slowed the cache a little", "0.3", q)
    big = publish(node, "the deploy broke the cache for every tenant", "0.9", q)
    # Ranked after the rest until a person reviews it, by the journal's door and the mirror's alike.
    assert safe_reads(node, q) == ([(small, None), (big, "awaiting review")], [(small, None), (big, "awaiting review")])
    awaiting = last_json(epibus(node, "audit", "--reviews", "-p", q, "--journal", "node", "--json"))
    assert ([a["artifact_id"] for a in awaiting["awaiting"]], awaiting["reviews"]) == ([big], [])

    pushed = [json.loads(line) for line in follow(node, 2)]  # a watch is told of both, with their status
    assert sorted((n["artifact_id"], n["review"]) for n in pushed) == sorted([(small, None), (big, "awaiting review")])

    epibus(node, "policy", "set", "-p", q, "--human-review-impact", "0.8", "--withhold")
    assert safe_reads(node, q) == ([(small, None)], [(small, None)])  # withheld from the safe door...
    again = publish(node, "the deploy broke the cache for every tenant once more", "0.9", q)
    after = publish(node, "the deploy slowed the cache once more", "0.3", q)
    # ...and from a watch: the next notice is the claim published after it.
    assert [json.loads(line)["artifact_id"] for line in follow(node, 1)] == [after]
    assert again not in [a for a, _ in safe_reads(node, q)[0]]
    audited = last_json(epibus(node, "audit", "-p", q, "--journal", "node", "--json"))
    assert {a["artifact_id"]: a["review"] for a in audited} == {  # ...not hidden
        small: None,
        big: "awaiting review",
        again: "awaiting review",
        after: None,
    }

    epibus(node, "person", "add", "gil", "-p", q, "--passphrase-stdin", stdin_text=PASSPHRASE + "\n")
    epibus(node, "verify", big, "-p", q, "--person", "gil", "--passphrase-stdin", stdin_text=PASSPHRASE + "\n")

    def reviewed() -> bool:  # first by relevance and by similarity now, no longer held back
        listed, recalled = safe_reads(node, q)
        return listed[0] == recalled[0] == (big, "reviewed") and {*listed[1:]} == {*recalled[1:]} == {
            (small, None),
            (after, None),
        }

    assert eventually_sync(reviewed, timeout_s=20)
    who = last_json(epibus(node, "audit", "--reviews", "-p", q, "--journal", "node", "--json"))
    assert ([a["artifact_id"] for a in who["awaiting"]], [(r["artifact_id"], r["person"]) for r in who["reviews"]]) == (
        [again],
        [(big, "gil")],
    )

    shown = last_json(epibus(node, "policy", "show", "-p", q, "--json"))
    assert (shown["policy"]["mode"], shown["policy"]["set_by"]) == ("withhold", made_by_operator(node))


def made_by_operator(home: Path) -> str:
    """The identity the CLI signs with under a node's home: the node's own (its operator)."""
    return node_key(home).agent_id


def test_only_an_admin_of_the_project_sets_its_review_policy(node: Path, tmp_path: Path) -> None:
    info = read_node_info(node)
    assert info is not None
    url = info.nats_url
    mallory = AgentKey.load_or_create(tmp_path, "mallory")
    epibus(node, "agent", "add", "mallory", "--key", mallory.public_key, "-p", "weighty2")
    refused = run_epibus(tmp_path, "policy", "set", "-p", "weighty2", "--human-review-impact", "0.1", "--nats", url,
                         "--agent", "mallory", check=False)  # fmt: skip
    assert "only an admin may" in one_line_error(refused)
    shown = last_json(run_epibus(tmp_path, "policy", "show", "-p", "weighty2", "--nats", url, "--agent", "mallory",
                                 "--json"))  # fmt: skip
    assert shown["policy"] is None  # nothing was recorded
