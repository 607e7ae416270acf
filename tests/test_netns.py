"""Emulated hosts: the tc commands of each veth end, the rate each end is shaped to,
bad specs named, and the name service each namespace sees."""

import os
import shutil
import subprocess
import sys

import pytest

from hpmoe.launch.launcher import left_by
from hpmoe.launch.netns import (
    LinkSpec,
    Topology,
    create_topology,
    delete_topology,
    list_namespaces,
    name_service_files,
    tier_commands,
)

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "unshare")),
    reason="network namespaces need root, ip, tc and unshare")


def test_other_nodes_go_to_the_inter_node_class():
    link = LinkSpec("2gbit", inter="400mbit", ranks_per_node=2)
    cmds = tier_commands(link, rank=1, world=4, match="dst")
    assert cmds[0][:6] == ["qdisc", "add", "dev", "eth0", "root", "handle"]
    assert cmds[1][9:11] == ["rate", "2gbit"] and cmds[2][9:11] == ["rate", "400mbit"]
    peers = [c[c.index("match") + 3] for c in cmds[3:]]
    assert peers == [f"{Topology.address(r)}/32" for r in (2, 3)]  # ranks 2, 3: the other node
    assert all(c[-1] == "1:20" for c in cmds[3:])
    hub = tier_commands(link, rank=2, world=4, match="src")
    assert hub[0][3] == "p2" and [c[c.index("match") + 2] for c in hub[3:]] == ["src", "src"]
    assert [c[c.index("match") + 3] for c in hub[3:]] == [f"{Topology.address(r)}/32" for r in (0, 1)]


def test_bad_two_tier_specs_are_named():
    with pytest.raises(ValueError, match="LinkSpec.inter="):
        LinkSpec("2gbit", inter="fast", ranks_per_node=2)
    with pytest.raises(ValueError, match="LinkSpec.ranks_per_node"):
        LinkSpec("2gbit", inter="1gbit")
    with pytest.raises(ValueError, match="needs an inter-node rate"):
        LinkSpec("2gbit", ranks_per_node=2)
    assert LinkSpec("2gbit").node(5) == 0 and LinkSpec("2gbit", "1gbit", 4).node(5) == 1


def test_every_namespace_names_every_rank_and_looks_names_up_in_files_only():
    topo = Topology(token="0" * 8, hub="h", ranks=("a", "b", "c"), link=LinkSpec("1gbit"))
    files = name_service_files(topo)
    hosts = files["hosts"].splitlines()
    assert [f"{topo.address(r)} {topo.host_name(r)}" for r in range(3)] == hosts[-3:]
    assert [x for x in files["nsswitch.conf"].splitlines() if x.startswith("hosts:")] == ["hosts: files"]
    assert "nameserver" not in files["resolv.conf"]


# A machine whose resolver no namespace can reach, and whose hosts file names no rank:
# without the namespaces' own files, c10d's reverse lookup of each peer fails (EAI_AGAIN)
# and every rank warns "The hostname of the client socket cannot be retrieved".
_UNRESOLVING = """printf 'nameserver 192.0.2.53\\noptions timeout:1 attempts:1\\n' > "$1/resolv.conf"
printf '127.0.0.1 localhost\\n' > "$1/hosts"
printf 'hosts: files dns\\n' > "$1/nsswitch.conf"
for f in resolv.conf hosts nsswitch.conf; do mount --bind "$1/$f" "/etc/$f"; done
shift; exec "$@"
"""


@needs_namespaces
def test_ranks_in_namespaces_print_nothing_where_the_machine_cannot_resolve_their_names(tmp_path):
    bench = [sys.executable, "-m", "hpmoe", "bench", "--ep", "2", "--preset", "tiny", "--tokens", "32",
             "--tile-rows", "8", "--gemm-rows", "8", "--gemm-cols", "16", "--warmup", "1", "--iters", "2",
             "--schedule", "hyperparallel", "--deadline", "10", "--link", "1gbit"]
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _UNRESOLVING, "sh",
            str(tmp_path), *bench]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=180)  # unshare and sh exec: proc.pid is the launcher's
    assert proc.returncode == 0, err
    assert all(x.startswith("hpmoe bench: ") for x in err.splitlines()), err
    assert left_by(proc.pid) == [], "namespaces or their /etc/netns files outlived the job"


@needs_namespaces
def test_both_ends_of_every_ranks_link_are_shaped_to_the_links_rate():
    """What ``--link 1gbit`` builds, read back from the kernel: a token-bucket qdisc at
    1 Gbit/s on each rank's end of its veth pair and on the hub's end (the rate a link
    then carries is a benchmark's figure: ``hpmoe bench --link``)."""
    topo = create_topology(2, LinkSpec("1gbit"), os.urandom(8).hex())
    try:
        ends = [(ns, "eth0") for ns in topo.ranks] + [(topo.hub, f"p{r}") for r in range(2)]
        for ns, dev in ends:
            shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, check=True).stdout.split()
            assert shown[:2] == ["qdisc", "tbf"] and shown[shown.index("rate") + 1] == "1Gbit", (ns, dev)
    finally:
        delete_topology(topo)
    assert not {*topo.ranks, topo.hub} & set(list_namespaces())


@needs_namespaces
def test_a_shaped_loopback_is_shaped_inside_and_gone_after():
    from hpmoe.launch.netns import shaped_loopback

    with shaped_loopback("1gbit") as prefix:
        shown = subprocess.run([*prefix, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                               check=True).stdout.split()
        assert shown[:2] == ["qdisc", "tbf"] and shown[shown.index("rate") + 1] == "1Gbit"
        ns = prefix[-1]
        assert ns in list_namespaces()
    assert ns not in list_namespaces()
    with pytest.raises(ValueError, match="rate"), shaped_loopback("fast"):
        pass
