"""The lineage read from the journal agrees with the lineage of the client's own fold of the stream, for every
artifact of a real history published to a real nats-server and journaled by a real node."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from bus.client.client import EpibusClient
from bus.errors import NotFound
from bus.model.lineage import MissingLink, lineage
from bus.model.vocab import ReceiptLevel, Trust
from epibus.node.node import Node
from observers.reads import artifact_lineage, snapshot
from tests.conftest import finding
from tests.observers.test_state_projection import agents, settled

__all__ = ["agents"]  # alice, bob and carol, each with a client of its own


async def claim(client: EpibusClient, project: str, text: str, **links: str) -> str:
    event = client.event("finding", finding(text=text) | links, project=project)
    await client.publish(event, wait_for=ReceiptLevel.journaled)
    return event.artifact_id


async def publish_history(agents: dict[str, EpibusClient], project: str) -> dict[str, str]:
    """Revisions two deep and a sibling, a supersession chain of three made both ways, two contradictions by
    one artifact, and a revision of an artifact that was then forgotten."""
    alice, bob, carol = agents["alice"], agents["bob"], agents["carol"]
    ids = {"base": await claim(alice, project, "the scheduler starves small jobs")}
    await bob.transition("verified", {"note": "reproduced"}, project=project, artifact_id=ids["base"])
    ids["child"] = await claim(alice, project, "raising the quantum fixes it", revises=ids["base"])
    ids["grandchild"] = await claim(alice, project, "a quantum of 50 ms is best", revises=ids["child"])
    ids["sibling"] = await claim(carol, project, "small jobs wait on locks too", revises=ids["base"])
    ids["old"] = await claim(alice, project, "p99 is 6 ms")
    ids["new"] = await claim(alice, project, "p99 is 4 ms", supersedes=ids["old"])
    ids["newer"] = await claim(alice, project, "p99 is 3 ms")
    await alice.transition(
        "resolved", {"resolution": "superseded", "superseded_by": ids["newer"]}, project=project, artifact_id=ids["new"]
    )
    for name, text in (("wrong", "the scheduler is fair"), ("rumour", "small jobs never wait")):
        ids[name] = await claim(carol, project, text)
        body = {"contradicted_by": ids["base"], "reason": "measured otherwise"}
        await bob.transition("contradicted", body, project=project, artifact_id=ids[name])
    ids["secret"] = await claim(alice, project, "the admin password is hunter2")
    ids["leaf"] = await claim(alice, project, "the password is in the log", revises=ids["secret"])
    await alice.forget(project, ids["secret"], reason="personal data")
    return ids


async def test_the_journal_lineage_agrees_with_the_clients_fold_for_every_artifact(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    assert node.journal is not None
    ids = await publish_history(agents, project)
    await settled(node.journal, agents["alice"], project)
    view = await agents["alice"].project_view(project)
    folded = view.fold.artifacts
    assert set(folded) == set(ids.values()) - {ids["secret"]}  # the forgotten one left the fold
    assert set(snapshot(node.journal, project).states) == set(folded)  # and the journal
    now = datetime.now(UTC)
    for aid in folded:
        expected = lineage(folded, aid)
        assert artifact_lineage(node.journal, project, aid) == expected  # the live projection
        assert artifact_lineage(node.journal, project, aid, as_of=now) == expected  # folded from its events

    # The agreement is about lineages that hold something: each link type, read back through the journal.
    of = {name: artifact_lineage(node.journal, project, aid) for name, aid in ids.items() if name != "secret"}
    assert [m.artifact_id for m in of["grandchild"].ancestors] == [ids["child"], ids["base"]]
    assert [(d.member.artifact_id, d.depth) for d in of["base"].descendants] == [
        (ids["child"], 1),
        (ids["sibling"], 1),
        (ids["grandchild"], 2),
    ]
    assert of["grandchild"].ancestors[1].trust is Trust.verified
    chain = [ids["old"], ids["new"], ids["newer"]]
    for name in ("old", "new", "newer"):
        shown = of[name]
        whole = [*reversed(shown.supersedes), shown.artifact, *shown.superseded_by]
        assert [m.artifact_id for m in whole] == chain
    assert [m.artifact_id for m in of["base"].contradicts] == [ids["wrong"], ids["rumour"]]
    assert of["wrong"].contradicted_by is not None
    assert of["wrong"].contradicted_by.artifact_id == ids["base"]
    assert of["leaf"].missing == (MissingLink(ids["leaf"], "revises", ids["secret"]),)
    assert of["leaf"].ancestors == ()


async def test_an_unknown_artifact_is_not_found_in_the_journal_naming_it_and_its_project(
    node: Node, agents: dict[str, EpibusClient], project: str
) -> None:
    assert node.journal is not None
    await claim(agents["alice"], project, "one claim so that the project exists")
    with pytest.raises(NotFound) as raised:
        artifact_lineage(node.journal, project, "no-such-artifact")
    assert str(raised.value).startswith(f"artifact 'no-such-artifact' not found; project '{project}' holds no such")
