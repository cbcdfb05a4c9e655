"""`epibus dlq list|replay`: dead letters, with the reason each consumer gave them up."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from nats.aio.msg import Msg

from bus.broker.nats_errors import NATS_OR_API_ERROR
from bus.errors import ConfigError, InvalidEvent, Unavailable
from bus.intake.reader import dead_letters
from bus.intake.runner import signature_headers
from bus.subjects import (
    DLQ_CONSUMER,
    DLQ_ERROR,
    DLQ_REASON,
    DLQ_STREAM,
    DLQ_STREAM_SEQ,
    DLQ_SUBJECT,
    MSG_ID_HEADER,
    dlq_filter,
)
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    Target,
    WideOpt,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown

dlq_app = typer.Typer(
    help="Dead letters: events a consumer gave up on or refused, with the reason.", no_args_is_help=True
)


# -- dlq --------------------------------------------------------------------------------------------------


def _dlq_row(msg: Msg) -> dict[str, Any]:
    headers = msg.headers or {}
    return {
        "dlq_seq": msg.metadata.sequence.stream,
        "reason": headers.get(DLQ_REASON),
        "consumer": headers.get(DLQ_CONSUMER),
        "subject": headers.get(DLQ_SUBJECT),
        "stream_seq": int(headers[DLQ_STREAM_SEQ]) if DLQ_STREAM_SEQ in headers else None,
        "error": headers.get(DLQ_ERROR),
        "bytes": len(msg.data),
    }


@dlq_app.command("list")
@handles_errors
def dlq_list(
    consumer: Annotated[str | None, typer.Option("--consumer", help="Only this consumer's dead letters.")] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """List dead letters with their reasons."""
    rows = run(_dlq_list(consumer, Target(nats, home, agent)))
    if as_json:
        emit_json(rows)
        return
    console.print(
        table(
            f"{len(rows)} dead letter(s)",
            ["dlq_seq", "reason", "consumer", "subject", "stream_seq", "error"],
            [[r["dlq_seq"], r["reason"], r["consumer"], r["subject"], r["stream_seq"], r["error"]] for r in rows],
        )
    )


async def _dlq_list(consumer: str | None, target: Target) -> list[dict[str, Any]]:
    nc = await target.connect()
    try:
        return [_dlq_row(m) for m in await dead_letters(nc.jetstream(), filter_subject=dlq_filter(consumer))]
    finally:
        await nc.close()


@dlq_app.command("replay")
@handles_errors
def dlq_replay(
    seq: Annotated[list[int] | None, typer.Option("--seq", help="DLQ sequence to replay (repeatable).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Leave replayed messages in the DLQ.")] = False,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish dead letters again on their original subjects (every consumer sees them again; sinks dedupe by
    event id), then remove them from the DLQ."""
    if not seq and not all_:
        raise ConfigError("dlq replay", "name dead letters with --seq N (repeatable) or pass --all")
    replayed = run(_dlq_replay(set(seq or []), all_, keep, Target(nats, home, agent)))
    if as_json:
        emit_json({"ok": True, "replayed": replayed})
    else:
        console.print(shown(f"replayed {len(replayed)} dead letter(s): {replayed}"))


async def _dlq_replay(seqs: set[int], all_: bool, keep: bool, target: Target) -> list[int]:
    nc = await target.connect()
    js = nc.jetstream()
    replayed: list[int] = []
    try:
        letters = [m for m in await dead_letters(js) if all_ or m.metadata.sequence.stream in seqs]
        missing = seqs - {m.metadata.sequence.stream for m in letters}
        if missing:
            raise ConfigError("--seq", f"no dead letter with sequence {sorted(missing)}; see `epibus dlq list`")
        for msg in letters:
            row = _dlq_row(msg)
            if not row["subject"]:
                raise InvalidEvent(f"dead letter {row['dlq_seq']}", "has no original subject header")
            headers = {MSG_ID_HEADER: f"dlq-replay:{row['consumer']}:{row['stream_seq']}:{row['dlq_seq']}"}
            headers |= signature_headers(msg.headers)  # a schema_version 2 event is signed in them
            try:
                await js.publish(row["subject"], msg.data, headers=headers, timeout=10)
                if not keep:
                    await js.delete_msg(DLQ_STREAM, row["dlq_seq"])
            except NATS_OR_API_ERROR as e:
                raise Unavailable("nats", f"replaying dead letter {row['dlq_seq']}: {type(e).__name__} {e}") from e
            replayed.append(row["dlq_seq"])
    finally:
        await nc.close()
    return replayed
