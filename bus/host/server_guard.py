"""What keeps the embedded nats-server from outliving its node or doubling on a store: the thread every server is
forked from, the parent-death signal, the store directory's lock and pid file, and finding leftover servers."""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import TypeVar, cast

from bus.errors import Unavailable
from bus.host.home import private_dir, write_private
from bus.host.processes import alive, start_time

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a server gets when the process that started it dies; 0 sends nothing (as on a platform without it).
PARENT_DEATH_SIGNAL: int = signal.SIGKILL
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive PARENT_DEATH_SIGNAL when its parent dies (Linux).

    Built in the parent so the child only makes two system calls. If the parent died before the signal was
    armed, the child exits at once instead of running orphaned."""
    parent_pid = os.getpid()
    signum = PARENT_DEATH_SIGNAL

    def arm() -> None:
        if _LIBC is None or not signum:
            return
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


class Spawner:
    """One thread, living as long as the process, that every server is forked from.

    Linux sends the parent-death signal when the *thread* that forked the child exits, so a server forked from
    an `asyncio.to_thread` worker or a timer thread would be killed when that thread ends."""

    def __init__(self) -> None:
        self._requests: SimpleQueue[tuple[Callable[[], object], Future[object]]] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_thread)

    def _forget_thread(self) -> None:
        self._thread = None  # a forked child has no copy of the thread
        self._guard = threading.Lock()
        self._requests = SimpleQueue()

    def run(self, fork: Callable[[], T]) -> T:
        """Call `fork` on the spawner thread and return what it returned (or raise what it raised)."""
        with self._guard:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="epibus-spawner", daemon=True)
                self._thread.start()
        done: Future[object] = Future()
        self._requests.put((fork, done))
        return cast(T, done.result())

    def _serve(self) -> None:
        while True:
            fork, done = self._requests.get()
            try:
                done.set_result(fork())
            except Exception as e:  # noqa: BLE001 - not swallowed: the caller waiting on `done` raises it
                done.set_exception(e)


SPAWNER = Spawner()


def _names_path_in(argv: list[str], cwd: Path, root: Path) -> bool:
    for arg in argv[1:]:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if not value or value.startswith("-"):
            continue
        path = Path(os.path.normpath(cwd / value))
        if path == root or root in path.parents:
            return True
    return False


def servers_on(store_dir: Path) -> list[int]:
    """Pids of running nats-server processes whose command line names the store directory or a file in it
    (`-c <store>/nats-server.conf`, `-sd <store>`, ...)."""
    root = store_dir.resolve()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            if Path(argv[0]).name != "nats-server":
                continue
            cwd = Path(os.readlink(entry / "cwd"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or another user's (it could not open our store anyway)
        if _names_path_in(argv, cwd, root) and alive(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def terminate(pid: int, *, grace_s: float = 5.0) -> None:
    """SIGTERM (the server closes its store cleanly), SIGKILL after grace_s; returns once the process is gone."""
    started = start_time(pid)
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not alive(pid, started):
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        except PermissionError as e:
            raise Unavailable("nats-server", f"cannot stop process {pid} ({e}); stop it as its user") from e
        deadline = time.monotonic() + wait_s
        while alive(pid, started) and time.monotonic() < deadline:
            time.sleep(0.05)
    if alive(pid, started):
        raise Unavailable("nats-server", f"process {pid} survived SIGKILL for 10s; stop it by hand")


@dataclass(frozen=True)
class PidRecord:
    """Who runs a server on a store directory: the owning process (pid and start time) and its server."""

    owner_pid: int
    owner_started: int | None
    server_pid: int | None = None
    server_started: int | None = None

    def owner_alive(self) -> bool:
        return alive(self.owner_pid, self.owner_started)

    def server_alive(self) -> bool:
        return self.server_pid is not None and alive(self.server_pid, self.server_started)


class StoreLock:
    """An exclusive flock on `<store>/nats-server.lock` and the pid file next to it.

    The lock's file descriptor is handed to the server (`pass_fds`), so the lock stays held for as long as
    either the owner or its server lives: an orphaned server still marks the directory as in use."""

    def __init__(self, store_dir: Path) -> None:
        self.path = store_dir / "nats-server.lock"
        self.pid_file = store_dir / "nats-server.pid"
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (idempotent); False when another holds it."""
        if self.fd is not None:
            return True
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        self.record(None)
        return True

    def record(self, server_pid: int | None) -> None:
        """Write the pid file (only while holding the lock): this process owns the directory, and runs server_pid."""
        me = os.getpid()
        server_started = start_time(server_pid) if server_pid is not None else None
        entry = PidRecord(me, start_time(me), server_pid, server_started)
        write_private(self.pid_file, json.dumps(asdict(entry)))

    def holder(self) -> PidRecord | None:
        """The pid file's record, or None when there is none (yet) or it is unreadable."""
        try:
            return PidRecord(**json.loads(self.pid_file.read_text()))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, TypeError) as e:
            log.warning("ignoring unreadable %s: %s", self.pid_file, e)
            return None

    def release(self) -> None:
        """Remove the pid file and let go of the lock (idempotent)."""
        if self.fd is None:
            return
        self.pid_file.unlink(missing_ok=True)
        os.close(self.fd)  # a server still running holds its own copy of the lock
        self.fd = None
