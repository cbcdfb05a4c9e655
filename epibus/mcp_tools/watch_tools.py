"""The watches' MCP tools: keep a standing question, list and stop them, and poll what they pushed (a client
calls `notices` with the last `seq` it was given: nothing is missed or told twice)."""

from __future__ import annotations

from bus.client.watch import notice_line
from epibus.mcp_tools import inputs as i
from epibus.mcp_tools.schema import ToolInput
from epibus.mcp_tools.session import AgentSession
from epibus.mcp_tools.tools import Result, ToolSpec


async def watch(session: AgentSession, args: i.WatchInput) -> Result:
    client = await session.client()
    made = await client.watch(
        args.about, args.projects, kinds=args.kinds, threshold=args.threshold, days=args.days, audit=args.audit
    )
    return {"ok": True, "watch": made.model_dump(mode="json")}


async def watches(session: AgentSession, args: ToolInput) -> Result:
    listed, limit = await (await session.client()).watches.list_own()
    return {"watches": [w.model_dump(mode="json") for w in listed], "limit": limit}


async def stop_watch(session: AgentSession, args: i.WatchStopInput) -> Result:
    return {"ok": True, "stopped": await (await session.client()).watches.stop(args.watch_id)}


async def notices(session: AgentSession, args: i.NoticesInput) -> Result:
    client = await session.client()
    found = await client.watches.poll(after_seq=args.after_seq, limit=args.limit, wait_s=max(args.wait_s, 0.5))
    last = found[-1].seq if found else args.after_seq
    return {"notices": [notice_line(p) for p in found], "next_after_seq": last}


def watch_tools() -> list[ToolSpec]:
    return [
        ToolSpec(
            "watch",
            "Keep a standing question: every claim recorded from now on in these projects whose meaning is close "
            "to `about` is pushed to you once (read them with `notices`); one retracted after the push is followed "
            "by a no_longer_trusted notice.",
            i.WatchInput,
            watch,
        ),
        ToolSpec("watches", "Your standing questions and how many you may hold.", ToolInput, watches, read_only=True),
        ToolSpec("stop_watch", "Stop one of your standing questions.", i.WatchStopInput, stop_watch, destructive=True),
        ToolSpec(
            "notices",
            "What your watches pushed after `after_seq` (pass back `next_after_seq` next time), waiting up to "
            "`wait_s` seconds when nothing is there yet.",
            i.NoticesInput,
            notices,
            read_only=True,
        ),
    ]
