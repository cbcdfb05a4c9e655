"""Linux network namespaces for the nodes of a one-machine cluster, so that a real network partition can be made
between their nats-servers: `Namespaces(3)` makes a bridge in the root namespace and three namespaces, each with
a veth into the bridge and an address in a private /24 that no route of this machine uses. The bridge holds the
subnet's .254, so processes in the root namespace reach every namespace. `partition(a, b)` drops every packet
between the two sides (blackhole routes inside each namespace, which stall established TCP connections as a cut
cable does), `heal()` undoes it, `close()` removes everything.

Names carry a tag made of the owner's pid (base 36) and a per-process counter: `epibus-<tag>-<i>` for the
namespaces, `eb-<tag>` for the bridge, `eb-<tag>-<i>` for the root side of each veth. A process killed before it
could close its namespaces leaves them behind; the next `Namespaces` (or `remove_stale()`) removes those whose
pid no longer runs. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip`."""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from bus.errors import EpibusError
from bus.host.processes import alive

IP_TIMEOUT_S = 15.0
LOCK_WAIT_S = 60.0
MAX_SIZE = 9  # one digit in interface names, which may be 15 characters at most
SUBNET_FIRST, SUBNET_LAST = 0, 255  # 10.213.<x>.0/24
NETNS_PREFIX, LINK_PREFIX, PEER_PREFIX = "epibus-", "eb-", "en-"
_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole", "nat")
_NETNS_NAME = re.compile(rf"^{NETNS_PREFIX}([0-9a-z]+)-([0-9a-z]+)-(\d+)$")
_LINK_NAME = re.compile(rf"^{LINK_PREFIX}([0-9a-z]+)-([0-9a-z]+)(?:-\d+)?$")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_counter = itertools.count()
_open_tags: set[str] = set()  # the tags this process made and has not closed: never stale


class NetnsError(EpibusError):
    """An `ip` command failed, or this machine cannot make network namespaces."""


def ip_binary() -> str | None:
    found = shutil.which("ip")
    if found is not None:
        return found
    return next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def ip(*args: str, netns: str | None = None) -> str:
    """Run `ip [-n NETNS] ARGS...` and return its output. Raises NetnsError with its stderr."""
    binary = ip_binary()
    if binary is None:
        raise NetnsError("no `ip` command on PATH, /usr/sbin or /sbin; install iproute2")
    argv = [binary, *(["-n", netns] if netns else []), *args]
    shown = " ".join(argv[1:])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`ip {shown}` did not finish in {IP_TIMEOUT_S:.0f}s; see what holds the network") from e
    if done.returncode != 0:
        raise NetnsError(f"`ip {shown}` failed with {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _capable(*caps: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return all(effective & (1 << cap) for cap in caps)
    return False


def netns_unavailable() -> str | None:
    """None when this process can make network namespaces, else the plain reason why not."""
    if ip_binary() is None:
        return "network namespaces need iproute2's `ip` command, which is not installed"
    if not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux with /proc mounted"
    if os.geteuid() != 0 and not _capable(_CAP_NET_ADMIN, _CAP_SYS_ADMIN):
        return f"network namespaces need root or CAP_NET_ADMIN and CAP_SYS_ADMIN (running as uid {os.geteuid()})"
    probe = f"{NETNS_PREFIX}probe-{_base36(os.getpid())}"
    try:
        ip("netns", "add", probe)
    except NetnsError as e:
        return f"this machine refuses a network namespace: {e}"
    try:
        ip("netns", "del", probe)
    except NetnsError as e:
        return f"a probe network namespace could not be removed: {e}"
    return None


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, digit = divmod(number, 36)
        out = digits[digit] + out
        if number == 0:
            return out


@contextmanager
def _machine_lock() -> Iterator[None]:
    """One process at a time chooses a subnet and creates or removes namespaces: two runs never pick one /24."""
    run_dir = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
    fd = os.open(run_dir / "epibus-netns.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as e:
                if time.monotonic() > deadline:
                    raise NetnsError(
                        f"{run_dir / 'epibus-netns.lock'} stayed locked for {LOCK_WAIT_S:.0f}s; "
                        f"find its holder with `fuser {run_dir / 'epibus-netns.lock'}`"
                    ) from e
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _link_names() -> list[str]:
    names = []
    for line in ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            names.append(parts[1].strip().split("@")[0])
    return names


def _tag_is_stale(pid36: str, seq36: str) -> bool:
    pid = int(pid36, 36)
    if pid == os.getpid():  # our own pid: stale unless this process made it (a dead run had our pid)
        return f"{pid36}-{seq36}" not in _open_tags
    return not alive(pid)


def _remove_stale_locked() -> list[str]:
    removed = []
    # Links first, veths before bridges: deleting a veth's root end deletes the pair at once, whereas a deleted
    # namespace takes its devices down later (or never, while a process of the dead run still runs in it).
    for name in sorted(_link_names(), key=len, reverse=True):
        match = _LINK_NAME.match(name)
        if match and _tag_is_stale(match[1], match[2]):
            ip("link", "del", name)
            removed.append(name)
    for name in _netns_names():
        match = _NETNS_NAME.match(name)
        if match and _tag_is_stale(match[1], match[2]):
            ip("netns", "del", name)
            removed.append(name)
    return removed


def namespaces_made_by(pid: int) -> list[str]:
    """The network namespaces process `pid` made and has not removed (their names carry its pid)."""
    return [name for name in _netns_names() if (match := _NETNS_NAME.match(name)) and int(match[1], 36) == pid]


def remove_stale() -> list[str]:
    """Remove the namespaces, bridges and veths of runs whose process no longer runs; returns their names."""
    with _machine_lock():
        return _remove_stale_locked()


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to (the default route aside)."""
    used = []
    for line in ip("-o", "-4", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        fields = line.split()
        if not fields:
            continue
        target = fields[1] if fields[0] in _ROUTE_TYPES and len(fields) > 1 else fields[0]
        if target == "default":
            continue
        try:
            used.append(ipaddress.IPv4Network(target, strict=False))
        except ValueError:
            continue  # a route type this parser does not know: its target is elsewhere on the line
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for x in range(SUBNET_FIRST, SUBNET_LAST + 1):
        subnet = ipaddress.IPv4Network(f"10.213.{x}.0/24")
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise NetnsError("every 10.213.x.0/24 is in use on this machine; remove stale epibus bridges (`ip -o link`)")


class Namespaces:
    """`with Namespaces(3) as net:` gives three network namespaces joined by a bridge; run a process in
    namespace i with `net.exec_prefix(i) + argv`; it listens on `net.hosts[i]`."""

    def __init__(self, size: int) -> None:
        if not 1 <= size <= MAX_SIZE:
            raise NetnsError(f"{size} namespaces; make 1 to {MAX_SIZE}")
        seq = next(_counter)
        if seq >= 36**2:
            raise NetnsError("this process made 1296 sets of namespaces; start a new process for more")
        self.tag = f"{_base36(os.getpid())}-{_base36(seq)}"
        self.size = size
        self.bridge = f"{LINK_PREFIX}{self.tag}"
        self.names = tuple(f"{NETNS_PREFIX}{self.tag}-{i}" for i in range(size))
        self._veths = tuple(f"{LINK_PREFIX}{self.tag}-{i}" for i in range(size))
        self._peers = tuple(f"{PEER_PREFIX}{self.tag}-{i}" for i in range(size))
        self._cut: set[tuple[int, int]] = set()  # (i, j): namespace i drops what it sends to j
        self._closed = False
        self.subnet = ipaddress.IPv4Network("10.213.0.0/24")
        _open_tags.add(self.tag)
        atexit.register(self.close)
        try:
            with _machine_lock():
                _remove_stale_locked()
                self.subnet = _free_subnet()
                self._create()
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> tuple[str, ...]:
        """Each namespace's address (.1, .2, ...)."""
        return tuple(str(self.subnet.network_address + i + 1) for i in range(self.size))

    @property
    def bridge_host(self) -> str:
        """The root namespace's address on the bridge (.254)."""
        return str(self.subnet.network_address + 254)

    def exec_prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command in namespace i."""
        return [ip_binary() or "ip", "netns", "exec", self.names[i]]

    def _create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_host}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ip("netns", "add", name)
            ip("link", "add", self._veths[i], "type", "veth", "peer", "name", self._peers[i], "netns", name)
            ip("link", "set", self._veths[i], "master", self.bridge, "up")
            ip("link", "set", "lo", "up", netns=name)
            ip("addr", "add", f"{self.hosts[i]}/{self.subnet.prefixlen}", "dev", self._peers[i], netns=name)
            ip("link", "set", self._peers[i], "up", netns=name)

    def _indices(self, side: Sequence[int]) -> list[int]:
        bad = [i for i in side if not 0 <= i < self.size]
        if bad:
            raise NetnsError(f"namespace {bad[0]} does not exist; give indices 0 to {self.size - 1}")
        return list(side)

    def partition(self, side_a: Sequence[int], side_b: Sequence[int]) -> None:
        """No packet crosses between the two sides, either way, from now until `heal()`; the root namespace
        still reaches every namespace. Partitions add up."""
        a, b = self._indices(side_a), self._indices(side_b)
        if set(a) & set(b):
            raise NetnsError(f"namespaces {sorted(set(a) & set(b))} are on both sides; give two disjoint sides")
        for i, j in [*((i, j) for i in a for j in b), *((j, i) for i in a for j in b)]:
            if (i, j) not in self._cut:
                # A route, not a filter: sent packets are dropped before they leave, so established TCP stalls
                # (retransmitting) and new connections fail, as across a cut cable.
                ip("route", "replace", "blackhole", f"{self.hosts[j]}/32", netns=self.names[i])
                self._cut.add((i, j))

    @property
    def partitioned(self) -> frozenset[tuple[int, int]]:
        """(i, j) for every namespace i that cannot reach namespace j."""
        return frozenset(self._cut)

    def heal(self) -> None:
        """Remove every partition: stalled TCP connections resume, dropped packets are retransmitted."""
        for i, j in sorted(self._cut):
            ip("route", "del", "blackhole", f"{self.hosts[j]}/32", netns=self.names[i])
            self._cut.discard((i, j))

    def close(self) -> None:
        """Remove the namespaces, veths and bridge (safe to call twice). Stop what runs inside first: a
        namespace that still holds a process lives on, unnamed, until that process exits."""
        if self._closed:
            return
        errors: list[str] = []
        with _machine_lock():
            # Links first (see _remove_stale_locked), then the namespaces.
            present_links = set(_link_names())
            for link in (*self._veths, self.bridge):
                if link in present_links:
                    errors += _attempt("link", "del", link)
            present_ns = set(_netns_names())
            for name in self.names:
                if name in present_ns:
                    errors += _attempt("netns", "del", name)
        self._closed = True
        self._cut.clear()
        _open_tags.discard(self.tag)
        atexit.unregister(self.close)
        if errors:
            raise NetnsError(f"could not remove all of {self.tag}'s namespaces: {'; '.join(errors)}")

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _attempt(*args: str) -> list[str]:
    """Run one removal; its error, if any, as a message, so that close() goes on removing the rest."""
    try:
        ip(*args)
    except NetnsError as e:
        return [str(e)]
    return []
