"""`epibus doctor`'s checks of what lives on this machine: the journal's schema version, the mirror's embedding
model, the journal's pages, the home's free disk space against the reserve, the running node's last checks of
its stores and the file modes of the home and its keys. Each returns `Check` lines;
none of them creates or changes a file."""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from bus.errors import ConfigError, StoreDamaged, Unavailable
from bus.host.disk import disk_space
from bus.host.home import PRIVATE_DIR, PRIVATE_FILE
from bus.identity.signing import NODE_KEY_FILE
from bus.services.enrolments import local_agent_keys
from epibus.layers import LAYERS, claimed_by_others, shadowed_layers
from observers.journal import Journal
from observers.journal_engine import make_engine
from observers.schema import LATEST_VERSION, current_version

OK, WARN, FAIL = "ok", "warn", "fail"
# Free space on the home's filesystem: below the reserve (bus.host.disk) the stores hold their writes and the
# node takes no publishes; within this much above it, soon.
DISK_WARN_ABOVE_RESERVE_BYTES = 1 << 30  # 1 GiB
JOURNAL_TIMEOUT_S = 5  # a PostgreSQL server that does not answer fails the check instead of hanging it
MIRROR_DIR = "mirror"
MIRROR_META_FILE = "collection.json"  # written by the edge store beside its shard (observers/mirror/edge.py)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report: what was checked, ok | warn | fail, what was found, how to fix it."""

    check: str
    status: str
    detail: str
    hint: str = ""


def journal_check(url: str) -> Check:
    """The journal answers and its schema is the version this epibus writes."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return Check(
            "journal", FAIL, f"{url!r} is not a database URL", "use sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not Path(parsed.database).exists():
        return Check("journal", FAIL, f"{shown} does not exist", "`epibus up` creates it, or pass --journal URL")
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        url = parsed.update_query_dict({"connect_timeout": str(JOURNAL_TIMEOUT_S)}).render_as_string(False)
    try:
        engine = make_engine(url)
    except ConfigError as e:
        return Check("journal", FAIL, str(e), "pass --journal with a sqlite:/// or postgresql:// URL")
    try:
        version = current_version(engine)
    except SQLAlchemyError as e:
        first = str(e).splitlines()[0]
        return Check("journal", FAIL, f"{shown} did not answer: {first}", "start the database, or pass --journal URL")
    finally:
        engine.dispose()
    schema = schema_check(shown, version)
    if schema.status != OK:
        return schema
    return damage_check(url) or schema


def damage_check(url: str) -> Check | None:
    """SQLite's quick check of the journal's pages: a FAIL naming the damage and the rebuild, else None."""
    journal = Journal(url)
    try:
        journal.check()
    except StoreDamaged as e:
        return Check("journal", FAIL, f"damaged: {e.path}: {e.damage}", e.remedy)
    except Unavailable as e:
        return Check("journal", FAIL, str(e), "start the database, or pass --journal URL")
    finally:
        journal.close()
    return None


def schema_check(shown: str, version: int) -> Check:
    if version == LATEST_VERSION:
        return Check("journal", OK, f"{shown}, schema version {version}")
    if version < LATEST_VERSION:
        return Check(
            "journal",
            FAIL,
            f"{shown} has schema version {version}; this epibus needs {LATEST_VERSION}",
            "`epibus up` migrates it at start (restart the node)",
        )
    return Check(
        "journal",
        FAIL,
        f"{shown} has schema version {version}, newer than this epibus knows ({LATEST_VERSION})",
        "upgrade epibus on this machine (`pip install -U epibus`) to the version that wrote it",
    )


def mirror_check(home: Path, model_id: str, dimension: int) -> Check:
    """The edge mirror's collection was built for the embedder this home is configured with. `dimension` 0:
    not known without loading the model (a model other than the default), so only the model id is compared."""
    meta_path = home / MIRROR_DIR / MIRROR_META_FILE
    if not meta_path.exists():
        return Check("mirror", OK, f"no embedded mirror under {home} (mirror off, or on a Qdrant server)")
    try:
        meta = json.loads(meta_path.read_text())
        built = (str(meta["model_id"]), int(meta["dimension"]))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        return Check("mirror", FAIL, f"{meta_path} is unreadable ({e})", "rebuild the mirror: `epibus reindex`")
    wanted = f"{model_id} ({dimension}-d)" if dimension else model_id
    if built[0] != model_id or (dimension and built[1] != dimension):
        return Check(
            "mirror",
            FAIL,
            f"collection built with {built[0]} ({built[1]}-d); the configured embedder is {wanted}",
            "rebuild it for this model with `epibus reindex`, or set EPIBUS_EMBED_MODEL back to " + built[0],
        )
    return Check("mirror", OK, f"collection built with {built[0]} ({built[1]}-d), as configured")


def disk_check(home: Path) -> Check:
    space = disk_space(home)
    return disk_verdict(Path(space.path), space.free_bytes, space.reserve_bytes)


def disk_verdict(where: Path, free: int, reserve: int) -> Check:
    detail = f"{free / (1 << 30):.2f} GiB free on the filesystem of {where} (reserve {reserve // (1 << 20)} MiB)"
    if free < reserve:
        return Check(
            "disk space",
            FAIL,
            detail,
            "free space now: below the reserve the node takes no publishes and its stores hold their writes",
        )
    if free < reserve + DISK_WARN_ABOVE_RESERVE_BYTES:
        return Check("disk space", WARN, detail, "free some space, or move EPIBUS_HOME to a larger filesystem")
    return Check("disk space", OK, detail)


def store_checks(report: dict[str, Any] | None) -> list[Check]:
    """The running node's last checks of its stores (from its health report): a FAIL per damaged store."""
    if report is None:
        return []
    found = []
    for name, check in sorted((report.get("stores") or {}).items()):
        if check.get("state") == "damaged":
            found.append(Check(f"{name} pages", FAIL, f"damaged: {check.get('problem')}", str(check.get("remedy"))))
        else:
            found.append(Check(f"{name} pages", OK, f"{check.get('state')} at the node's last check"))
    return found


def layers_check() -> Check:
    """epibus's layers (bus, observers, mesh) are its own: no other distribution ships a package by one of those
    names, and none is shadowed on sys.path."""
    shadowed, claimed = shadowed_layers(), claimed_by_others()
    if shadowed or claimed:
        found = [f"{name} from {origin}" for name, origin in shadowed.items()]
        found += [f"{name} also installed by {', '.join(dists)}" for name, dists in claimed.items()]
        return Check("packages", FAIL, "; ".join(found), "install epibus in its own virtual environment")
    return Check("packages", OK, f"{', '.join(LAYERS)} are epibus's own")


def mode_checks(home: Path) -> list[Check]:
    """The home and its keys directory owner-only (0700), every key file owner-only (0600)."""
    if not home.exists():
        return [Check("home", WARN, f"{home} does not exist", "`epibus up` creates it")]
    found = [_mode_check(home, PRIVATE_DIR, "home")]
    if (home / "keys").is_dir():
        found.append(_mode_check(home / "keys", PRIVATE_DIR, "keys directory"))
    keys = [home / NODE_KEY_FILE] if (home / NODE_KEY_FILE).exists() else []
    keys += [path for _agent, path in local_agent_keys(home / "keys")]
    wrong = [check for check in (_mode_check(path, PRIVATE_FILE, "key") for path in keys) if check.status != OK]
    found += wrong or [Check("key files", OK, f"{len(keys)} key file(s), all 0600")]
    return found


def _mode_check(path: Path, wanted: int, what: str) -> Check:
    mode = stat.S_IMODE(path.lstat().st_mode)
    if mode & 0o077:
        return Check(
            f"{what} mode",
            FAIL,
            f"{path} is {mode:04o}: readable by others than its owner",
            f"chmod {wanted:o} {path}",
        )
    return Check(f"{what} mode", OK, f"{path} is {mode:04o}")
