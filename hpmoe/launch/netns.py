"""Emulated hosts: one network namespace per rank, joined through a bridge in a
hub namespace by veth pairs shaped with ``tc tbf`` in both directions, so that
communication between ranks is a bandwidth-bound resource of its own.  With two tiers
(``LinkSpec.inter``), ranks are grouped into nodes of ``ranks_per_node`` consecutive
ranks and each veth end has an ``htb`` class per tier: traffic to (from) ranks of
other nodes shares the ``inter`` rate, the rest the ``rate``, per direction.

Needs root, ``ip`` and ``tc``.  Namespaces are named ``hpm-p<pid>-<token>-...``
(the creating process, unique per run) and deleted by ``delete_topology`` — also
after a partial creation — or, when that process died first, by
``sweep_stale_namespaces``.

Each namespace also gets its own name-service files in ``/etc/netns/NAME/``, which
``ip netns exec`` mounts over ``/etc``: a hosts file naming every rank's address and an
nsswitch that looks host names up in files only.  Without them a rank asks the
machine's resolver, which a namespace cannot reach: c10d's reverse lookup of each
peer's address then fails (EAI_AGAIN) and every rank warns "The hostname of the client
socket cannot be retrieved", depending on how the machine resolves names.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..runtime.transport.segment import pid_alive

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
IFNAME = "eth0"  # each rank's interface inside its namespace
SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")  # per-namespace /etc files that ``ip netns exec`` mounts


def _rate_bytes(rate: str) -> float:
    value, unit = _RATE.match(rate).groups()
    return float(value) * _SCALE[unit] / 8.0


def _check_rate(name: str, rate: object) -> None:
    if not isinstance(rate, str) or not _RATE.match(rate):
        raise ValueError(f"{name}={rate!r} must look like 2gbit, 500mbit or 800kbit")
    if not _rate_bytes(rate) >= 1000:
        raise ValueError(f"{name}={rate!r} must be at least 8kbit")


def _burst(rate: str) -> str:
    """Bucket: 4 ms at the rate, at least 256 KiB (a GSO packet is <= 64 KiB)."""
    return f"{max(262144, int(_rate_bytes(rate) * 0.004))}b"


@dataclass(frozen=True)
class LinkSpec:
    """Per-rank, per-direction link rate in tc syntax (``2gbit``, ``500mbit``); with
    ``inter``, the rate to and from ranks of other nodes of ``ranks_per_node`` ranks."""

    rate: str
    inter: str | None = None
    ranks_per_node: int = 0

    def __post_init__(self) -> None:
        _check_rate("--link", self.rate)
        if self.inter is None:
            if self.ranks_per_node:
                raise ValueError(f"LinkSpec.ranks_per_node={self.ranks_per_node} needs an inter-node rate")
            return
        _check_rate("LinkSpec.inter", self.inter)
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node <= 0:
            raise ValueError(f"LinkSpec.ranks_per_node must be a positive int with inter, "
                             f"got {self.ranks_per_node!r}")

    @property
    def bytes_per_s(self) -> float:
        return _rate_bytes(self.rate)

    @property
    def burst(self) -> str:
        return _burst(self.rate)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node if self.inter else 0


@dataclass(frozen=True)
class Topology:
    """Created namespaces: ``ranks[r]`` holds rank r with address ``address(r)``."""

    token: str
    hub: str
    ranks: tuple[str, ...]
    link: LinkSpec

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @staticmethod
    def host_name(rank: int) -> str:
        return f"hpmoe-rank{rank}"

    def exec_prefix(self, rank: int) -> list[str]:
        """argv prefix that runs a command inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ranks[rank]]


def link_unavailable() -> str | None:
    """Why ranks cannot run in shaped network namespaces on this machine (not root, no
    ``ip`` or ``tc``), or None when they can (``create_topology`` may still refuse:
    ``TopologyError``, e.g. in a container without the network capability)."""
    if os.geteuid() != 0:
        return "not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"no `{'` or `'.join(missing)}` (iproute2)" if missing else None


class TopologyError(RuntimeError):
    """The namespaces or links could not be built (not root, no ``ip``/``tc``, a rate
    ``tc`` refuses)."""


def _run(*argv: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise TopologyError(f"--link needs `{argv[0]}` (iproute2), which is not installed") from None
    if proc.returncode:
        why = " ".join(proc.stderr.split())[:200]
        raise TopologyError(f"`{' '.join(argv)}` failed ({proc.returncode}): {why}"
                            + (" (--link needs root)" if os.geteuid() != 0 else ""))


def _shape(ns: str, dev: str, link: LinkSpec) -> None:
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
         link.rate, "burst", link.burst, "latency", "20ms")


def tier_commands(link: LinkSpec, rank: int, world: int, match: str) -> list[list[str]]:
    """tc arguments (after ``tc``) shaping one veth end of ``rank`` in two tiers: an
    htb class at ``link.rate`` (default) and one at ``link.inter`` that packets whose
    ``match`` address (``dst`` on the rank's side, ``src`` on the hub's) belongs to a
    rank of another node go to."""
    dev = IFNAME if match == "dst" else f"p{rank}"
    cmds = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", link.rate,
             "burst", _burst(link.rate)],
            ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", link.inter,
             "burst", _burst(link.inter)]]
    for peer in range(world):
        if link.node(peer) != link.node(rank):
            cmds.append(["filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                         "match", "ip", match, f"{Topology.address(peer)}/32", "flowid", "1:20"])
    return cmds


def create_topology(world: int, link: LinkSpec, token: str) -> Topology:
    """Namespaces for ``world`` ranks; on failure everything created is deleted."""
    if not isinstance(world, int) or not 1 <= world <= 250:
        raise ValueError(f"world={world!r} must be an int in [1, 250] for --link")
    prefix = f"hpm-p{os.getpid()}-{token[:8]}"
    topo = Topology(token=token, hub=f"{prefix}-hub",
                    ranks=tuple(f"{prefix}-r{r}" for r in range(world)), link=link)
    try:
        _run("ip", "netns", "add", topo.hub)
        _write_name_service(topo, topo.hub)
        _run("ip", "-n", topo.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", topo.hub, "link", "set", "br0", "up")
        for r in range(world):
            _add_rank(topo, r)
    except BaseException:
        delete_topology(topo)
        raise
    return topo


def _add_rank(topo: Topology, r: int) -> None:
    ns, port = topo.ranks[r], f"p{r}"
    _run("ip", "netns", "add", ns)
    _write_name_service(topo, ns)
    _run("ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", topo.hub)
    _run("ip", "-n", ns, "addr", "add", f"{topo.address(r)}/24", "dev", IFNAME)
    for dev in ("lo", IFNAME):
        _run("ip", "-n", ns, "link", "set", dev, "up")
    _run("ip", "-n", topo.hub, "link", "set", port, "master", "br0")
    _run("ip", "-n", topo.hub, "link", "set", port, "up")
    if topo.link.inter is None:
        _shape(ns, IFNAME, topo.link)
        _shape(topo.hub, port, topo.link)
        return
    for where, match in ((ns, "dst"), (topo.hub, "src")):
        for cmd in tier_commands(topo.link, r, len(topo.ranks), match):
            _run("ip", "netns", "exec", where, "tc", *cmd)


def name_service_files(topo: Topology) -> dict[str, str]:
    """The ``/etc`` files every namespace of ``topo`` sees: ``hosts`` is the machine's
    plus each rank's address, ``nsswitch.conf`` the machine's with host names looked up
    in files only, and ``resolv.conf`` names no server (none is reachable from there)."""
    hosts = ["127.0.0.1 localhost", "::1 localhost", *_lines("/etc/hosts")]
    hosts += [f"{topo.address(r)} {topo.host_name(r)}" for r in range(len(topo.ranks))]
    nss = [x for x in _lines("/etc/nsswitch.conf") if not x.strip().startswith("hosts:")]
    nss.append("hosts: files")
    return {"hosts": "\n".join(hosts) + "\n", "nsswitch.conf": "\n".join(nss) + "\n",
            "resolv.conf": "# emulated host of an hpmoe job: every rank is in /etc/hosts\n"}


def _lines(path: str) -> list[str]:
    p = Path(path)
    return p.read_text(errors="replace").splitlines() if p.is_file() else []


def _write_name_service(topo: Topology, ns: str) -> None:
    where = NETNS_ETC / ns
    try:
        where.mkdir(parents=True, exist_ok=True)
        for name, text in name_service_files(topo).items():
            (where / name).write_text(text)
    except OSError as e:
        raise TopologyError(f"cannot write {where}: {e.strerror} (--link needs root)") from None


def _delete(ns: str) -> None:
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def delete_topology(topo: Topology) -> list[str]:
    """Delete every namespace of ``topo`` that exists, with its ``/etc/netns`` files;
    returns the names deleted."""
    existing = set(list_namespaces())
    gone = []
    for ns in (*topo.ranks, topo.hub):
        if ns in existing or (NETNS_ETC / ns).exists():
            _delete(ns)
            gone.append(ns)
    return gone


@contextlib.contextmanager
def shaped_loopback(rate: str) -> Iterator[list[str]]:
    """One namespace whose loopback is shaped to ``rate`` with ``tc tbf``: every process
    run inside shares that one pipe, both directions of an exchange queue on it (a
    coarser model than ``create_topology``'s links, for one host's local ranks).  Yields
    the argv prefix that runs a command inside; the namespace is deleted on exit."""
    _check_rate("rate", rate)
    ns = f"hpm-p{os.getpid()}-{os.urandom(4).hex()}-hub"
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
             "burst", _burst(rate), "latency", "20ms")
        yield ["ip", "netns", "exec", ns]
    finally:
        _delete(ns)


def list_namespaces(prefix: str = "hpm-") -> list[str]:
    """Names of network namespaces starting with ``prefix``, and of those whose
    ``/etc/netns`` files are left."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = {line.split()[0] for line in out.splitlines() if line.startswith(prefix)}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)}
    return sorted(names)


_OWNER = re.compile(r"^hpm-p(\d+)-[0-9a-f]{8}-(hub|r\d+)$")


def sweep_stale_namespaces() -> list[str]:
    """Delete ``hpm-p<pid>-*`` namespaces whose creating process is dead (nothing
    without root or ``ip``); returns the names deleted."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    gone = []
    for ns in list_namespaces():
        m = _OWNER.match(ns)
        if m and not pid_alive(int(m.group(1))):
            _delete(ns)
            gone.append(ns)
    return gone
