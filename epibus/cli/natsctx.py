"""`epibus nats-context`: a context for the `nats` CLI that logs in to a node's authenticated server as an agent
(its nkey, its inboxes) or, with --as-node, as the node's operator, so `nats stream info`, `nats kv get` and
the like work against an epibus node without copying keys by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from bus.host.home import default_agent, epibus_home, resolve_nats_url, write_private
from bus.host.tls import CA_ENV, CERT_ENV, KEY_ENV
from bus.identity.signing import CREDS_ENV, NODE_KEY_FILE, AgentKey
from bus.model.auth import inbox_prefix
from epibus.cli.common import AgentOpt, HomeOpt, JsonOpt, NatsOpt, console, emit_json, handles_errors
from epibus.cli.display import shown


def contexts_dir() -> Path:
    """Where the `nats` CLI keeps its contexts: $XDG_CONFIG_HOME/nats/context (~/.config by default)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "nats" / "context"


def context_for(home: Path, agent: str, url: str, *, as_node: bool) -> dict[str, Any]:
    """The context's fields, as the `nats` CLI reads them."""
    if as_node:
        key_path = home / NODE_KEY_FILE
        key = AgentKey.load_or_create_at(key_path, "node")
        who = "the node's operator"
    else:
        key = AgentKey.load_or_create(home, agent)
        key_path = home / "keys" / f"{agent}.nk"
        who = f"agent {agent}"
    context: dict[str, Any] = {"description": f"epibus: {who} at {url}", "url": url}
    creds = os.environ.get(CREDS_ENV)
    if creds and not as_node:
        context["creds"] = creds
    else:
        context["nkey"] = str(key_path)
    if not as_node:  # an agent may receive only on its own inboxes
        context["inbox_prefix"] = inbox_prefix(key.public_key)
    for field, env in (("ca", CA_ENV), ("cert", CERT_ENV), ("key", KEY_ENV)):
        if value := os.environ.get(env):
            context[field] = value
    return context


@handles_errors
def nats_context(
    save: Annotated[bool, typer.Option("--save", help="Write it where the nats CLI finds it.")] = False,
    name: Annotated[str | None, typer.Option("--name", help="[default: epibus-AGENT or epibus-node]")] = None,
    as_node: Annotated[bool, typer.Option("--as-node", help="As the node's operator (its key, every right).")] = False,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A `nats` CLI context for this node: as --agent (confined to its projects, like any agent), or as the
    node's operator with --as-node. Prints it; --save writes it and says how to select it."""
    where = epibus_home(home)
    who = agent or default_agent()
    url = resolve_nats_url(nats, where)
    context = context_for(where, who, url, as_node=as_node)
    chosen = name or ("epibus-node" if as_node else f"epibus-{who}")
    path = contexts_dir() / f"{chosen}.json"
    if save:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(context, indent=2) + "\n", durable=True)  # it names a key file: 0600
    if as_json:
        emit_json({"ok": True, "name": chosen, "path": str(path) if save else None, "context": context})
        return
    if not save:
        console.print(shown(json.dumps(context, indent=2)), soft_wrap=True)
        console.print(shown(f"save it with: epibus nats-context --save (as {path})"), soft_wrap=True)
        return
    console.print(shown(f"saved {path}; select it with: nats context select {chosen}"), soft_wrap=True)
