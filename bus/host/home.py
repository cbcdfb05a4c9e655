"""Where a machine's epibus state lives (EPIBUS_HOME, default ~/.epibus) and how commands find the running
local node: `epibus up` records itself in `<home>/node.json`; everything else reads it, and a connection that
follows the node re-reads it when the node stops answering (`NodeFollower`)."""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bus.errors import ConfigError
from bus.host.processes import alive

log = logging.getLogger(__name__)
NODE_FILE = "node.json"
# A home holds a fleet's memory: readable by its owner only, whatever the umask.
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def epibus_home(explicit: Path | str | None = None) -> Path:
    raw = explicit if explicit is not None else os.environ.get("EPIBUS_HOME", "~/.epibus")
    home = Path(raw).expanduser().resolve()
    if home.exists() and not home.is_dir():
        raise ConfigError("EPIBUS_HOME", f"{home} is a file; point --home or EPIBUS_HOME at a directory")
    return home


def default_agent() -> str:
    """$EPIBUS_AGENT, else the login name made into a valid agent id."""
    configured = os.environ.get("EPIBUS_AGENT")
    if configured:
        return configured
    name = re.sub(r"[^a-z0-9_-]+", "-", getpass.getuser().lower()).strip("-_")
    return name or "agent"


NODE_NAME_FILE = "node-name"
NODE_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def node_name(home: Path, explicit: str | None = None) -> str:
    """The node's name in replies, verify rows and recall answers: `explicit` (`up --name`, then kept),
    else the name kept in home, else a new one made unique by a random suffix (host name + 4 hex), kept for
    later starts. Two nodes on one machine never share a default name. Raises ConfigError for a bad name."""
    path = home / NODE_NAME_FILE
    if explicit is not None:
        if not NODE_NAME_PATTERN.fullmatch(explicit):
            raise ConfigError("--name", f"{explicit!r} must match {NODE_NAME_PATTERN.pattern}")
        name = explicit
    elif path.exists():
        name = path.read_text().strip()
        if NODE_NAME_PATTERN.fullmatch(name):
            return name
        log.warning("%s holds no valid node name (%r); choosing a new one", path, name[:80])
        name = _new_node_name()
    else:
        name = _new_node_name()
    write_private(path, name + "\n")
    return name


def _new_node_name() -> str:
    import secrets  # here, not at the top: `epibus statusline` imports this module on every prompt
    import socket

    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().split(".")[0].lower()).strip("-")[:40] or "node"
    return f"{host}-{secrets.token_hex(2)}"


def default_journal_url(home: Path) -> str:
    return f"sqlite:///{home / 'journal.db'}"


def person_key_path(home: Path, name: str) -> Path:
    """Where a person's passphrase-encrypted key lives: apart from agents' keys (`keys/`), which are in clear and
    which any process started for an agent may load."""
    return home / "persons" / f"{name}.key"


def person_refusal(name: str) -> str:
    """Why a process started for an agent (a command's --agent, an MCP server, the statusline) will not run as
    this identity."""
    return (
        f"{name} is a person's identity: it signs only at the CLI, with `--person {name}` and the passphrase; no "
        "agent, MCP server or statusline runs as a person"
    )


def outbox_path(home: Path) -> Path:
    return home / "outbox.db"


@dataclass(frozen=True)
class NodeInfo:
    pid: int
    nats_url: str
    monitor_url: str | None
    journal_url: str
    outbox_path: str
    embedded_server: bool
    started_at: str
    name: str = ""  # the node's name (empty in files written before nodes had one)
    # The node's server authenticates agents; local clients enrol their agents with the node's key (auto_enrol).
    authenticated: bool = False
    auto_enrol: bool = False
    ui_url: str | None = None  # the node's dashboard, without its token (in <home>/ui.token); None: not served
    metrics_url: str | None = None  # the node's Prometheus endpoint (bearer token in <home>/metrics.token)

    def alive(self) -> bool:
        """True while the node's process runs. A node killed but not reaped yet (a zombie) is not running: a
        restart right after a `kill -9` must not be refused as "already running"."""
        return alive(self.pid)


def write_private(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace a state file atomically (a reader never sees half a file), readable by its owner only (0600, in
    a 0700 directory). `durable`: on disk before it replaces the old file (fsync), so a crash leaves either."""
    private_dir(path.parent)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, PRIVATE_FILE)  # a leftover tmp file keeps its old mode through O_CREAT
        f.write(text)
        if durable:
            f.flush()
            os.fsync(fd)
    tmp.replace(path)


def fsync_directory(path: Path) -> None:
    """Make the renames in a directory durable (its entries are on disk once this returns)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MIN_TOKEN_CHARS = 32


def secret_token(path: Path) -> str:
    """A secret kept in `path`: made once (random, 43 URL-safe characters), 0600 in an owner-only directory,
    so what was given out stays valid across restarts. Delete the file to rotate it. Raises ConfigError when
    the file holds too short a secret."""
    import secrets  # here, not at the top: `epibus statusline` imports this module on every prompt

    private_dir(path.parent)
    if not path.exists():
        # Written whole to a private temporary file, then linked into place: no reader ever sees it half-made,
        # and of two processes starting at once the first link wins and both use its secret.
        made = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
        try:
            os.link(made, path)
        except FileExistsError:
            pass  # another process made it first: use that one
        finally:
            made.unlink()
    owner_only(path)
    token = path.read_text().strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            "token",
            f"{path} holds {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; delete it and a new one is made",
        )
    return token


def private_dir(path: Path, *, tighten: bool = True) -> int | None:
    """Make `path` a directory only its owner can open (0700), whatever the umask. Missing directories on the
    way are created 0700; an existing `path` is stripped of group and other permissions, unless `tighten` is
    False (a directory the user chose to hold a file, not one of epibus's own). Returns the mode an existing
    directory had when it was tightened, else None. Raises ConfigError when it cannot be made owner-only."""
    missing: list[Path] = []
    at = path
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    try:
        for directory in reversed(missing):
            directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)  # a umask only takes bits away: 0700 at most
        if not path.is_dir():
            raise ConfigError(str(path), "is not a directory; move it away or choose another path")
        return owner_only(path) if tighten and not missing else None
    except OSError as e:
        raise ConfigError(str(path), f"cannot be made an owner-only directory ({e}); use a directory you own") from e


def owner_only(path: Path) -> int | None:
    """Strip group and other permissions from a file or directory (not through a symlink). Returns the mode it
    had when it changed, None when it already was owner-only or is gone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None  # removed meanwhile (an engine's temporary file): nothing is left to protect
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode) or not mode & 0o077:
        return None
    try:
        os.chmod(path, mode & 0o700)
    except FileNotFoundError:
        return None  # removed between the two calls (a worker renaming its temporary file)
    return mode


def private_tree(root: Path) -> None:
    """Make every directory and regular file under `root` owner-only: for files an engine creates through the
    process umask (qdrant-edge), tightened after each call that may create some. Symlinks are left alone."""
    for directory, _dirs, files in os.walk(root):
        owner_only(Path(directory))
        for name in files:
            owner_only(Path(directory, name))


def private_sqlite(path: Path) -> None:
    """Make an SQLite database owner-only before SQLite opens it: the file is created 0600 when missing (in a
    0700 directory when that is missing too), and it and any -wal, -shm or -journal file left from an earlier
    open are tightened. SQLite creates those side files with the database file's mode, whatever the umask."""
    private_dir(path.parent, tighten=False)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE))
    for file in (path, *(path.with_name(path.name + side) for side in SQLITE_SIDE_FILES)):
        owner_only(file)


def write_node_info(home: Path, info: NodeInfo) -> Path:
    path = home / NODE_FILE
    write_private(path, json.dumps(asdict(info), indent=2))
    return path


def read_node_info(home: Path) -> NodeInfo | None:
    """The running node recorded under home, or None when none is recorded or its process is gone."""
    path = home / NODE_FILE
    if not path.exists():
        return None
    try:
        info = NodeInfo(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError("node", f"{path} is unreadable ({e}); delete it if no node is running") from e
    return info if info.alive() else None


def remove_node_info(home: Path, pid: int) -> None:
    path = home / NODE_FILE
    if path.exists() and json.loads(path.read_text()).get("pid") == pid:
        path.unlink()


def explicit_nats_url(explicit: str | None) -> str | None:
    """--nats, else $EPIBUS_NATS_URL, else $NATS_URL (the NATS tools' own variable); None means "the local
    node, wherever node.json says it runs"."""
    return explicit or os.environ.get("EPIBUS_NATS_URL") or os.environ.get("NATS_URL") or None


def resolve_nats_url(explicit: str | None, home: Path) -> str:
    """--nats, else $EPIBUS_NATS_URL, else the running local node. Raises ConfigError naming the fixes."""
    url = explicit_nats_url(explicit)
    if url:
        return url
    node = read_node_info(home)
    if node is None:
        raise ConfigError(
            "nats",
            f"no epibus node is running under {home}, and this needs one: reads and state changes work on the "
            "node's current state (only `epibus publish` can wait in the outbox); start one with `epibus up` or "
            "pass --nats URL (or set EPIBUS_NATS_URL or NATS_URL)",
        )
    return node.nats_url


def split_servers(url: str) -> list[str]:
    return [u.strip() for u in url.split(",") if u.strip()]


class NodeFollower:
    """Where the local node runs, for a connection whose URL came from node.json: asked again after every
    failed (re)connect attempt, so a node restarted on other ports is found without restarting its clients."""

    def __init__(self, home: Path, servers: Sequence[str]) -> None:
        self.home = home
        self.servers = list(servers)
        self.moves = 0
        self.unreadable = 0  # node.json could not be read (counted and logged; the old servers are kept)

    def moved(self) -> list[str] | None:
        """The node's servers when node.json names a live node elsewhere than `servers`, else None."""
        try:
            node = read_node_info(self.home)
        except ConfigError as e:
            self.unreadable += 1
            log.warning("cannot tell where the local node went: %s", e)
            return None
        if node is None:
            return None  # stopped: it comes back where it was (its ports are kept), or says where in node.json
        servers = split_servers(node.nats_url)
        if servers == self.servers:
            return None
        self.servers = servers
        self.moves += 1
        return servers


def resolve_journal_url(explicit: str | None, home: Path) -> str:
    """--journal, else $EPIBUS_JOURNAL_URL, else the running node's journal, else the default SQLite file."""
    url = explicit or os.environ.get("EPIBUS_JOURNAL_URL")
    if url:
        return url
    node = read_node_info(home)
    return node.journal_url if node else default_journal_url(home)
