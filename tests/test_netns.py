"""Two-tier link shaping: the tc commands of each veth end, and bad specs named."""

import pytest

from hpmoe.launch.netns import LinkSpec, Topology, tier_commands


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
