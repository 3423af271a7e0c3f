"""The pure rules of NAT traversal: what relays' observations say of a NAT, which candidates are
offered and dialled, the LAN shortcut, how a link's path is named."""

from __future__ import annotations

from meshnode.traversal.candidates import (
    MAX_CANDIDATES,
    PathKind,
    classify_path,
    lan_addresses,
    own_candidates,
    vouched_candidates,
    worth_dialing,
)
from meshnode.traversal.nat_mapping import classify_mapping, mapping_name, punchable
from meshnode.wire.pb import mesh


def record(*addresses: str, observed: tuple[str, ...] = (), reachable: bool = False) -> mesh.PeerAnnouncement:
    return mesh.PeerAnnouncement(
        addresses=list(addresses), observed_addresses=list(observed), directly_reachable=reachable
    )


# -- the NAT's mapping ------------------------------------------------------------------------


def test_two_relays_seeing_one_port_mean_a_mapping_independent_of_the_destination():
    mapping = classify_mapping(["203.0.113.7:40001", "203.0.113.7:40001"], ["192.168.1.5:7447"])
    assert mapping == mesh.NAT_MAPPING_ENDPOINT_INDEPENDENT
    assert punchable(mapping) and mapping_name(mapping) == "endpoint-independent"


def test_two_relays_seeing_different_ports_mean_a_symmetric_nat_that_is_not_punched():
    mapping = classify_mapping(["203.0.113.7:40001", "203.0.113.7:51234"], ["192.168.1.5:7447"])
    assert mapping == mesh.NAT_MAPPING_ENDPOINT_DEPENDENT
    assert not punchable(mapping) and mapping_name(mapping) == "endpoint-dependent"


def test_one_relay_cannot_tell_and_a_relay_seeing_the_socket_itself_means_no_nat():
    assert classify_mapping(["203.0.113.7:40001"], ["192.168.1.5:7447"]) == mesh.NAT_MAPPING_UNKNOWN
    assert punchable(mesh.NAT_MAPPING_UNKNOWN)  # most home routers map independently: worth a try
    assert classify_mapping([], ["192.168.1.5:7447"]) == mesh.NAT_MAPPING_UNKNOWN
    assert classify_mapping(["198.51.100.2:7447"], ["198.51.100.2:7447"]) == mesh.NAT_MAPPING_NONE
    assert classify_mapping(["[2001:db8::2]:7447"], ["[2001:db8::2]:7447"]) == mesh.NAT_MAPPING_NONE
    assert classify_mapping(["garbage"], []) == mesh.NAT_MAPPING_UNKNOWN


# -- candidates ------------------------------------------------------------------------------


def test_a_node_offers_where_relays_see_it_first_then_what_it_announces_without_repeats():
    offered = own_candidates(["203.0.113.7:40001"], ["192.168.1.5:7447", "203.0.113.7:40001"])
    assert offered == ["203.0.113.7:40001", "192.168.1.5:7447"]
    many = own_candidates([f"203.0.113.{i}:1" for i in range(20)], [])
    assert len(many) == MAX_CANDIDATES


def test_only_candidates_the_peers_own_signed_record_announces_are_taken():
    peer = record("192.168.1.5:7447", observed=("203.0.113.7:40001",))
    offered = ["203.0.113.7:40001", "198.51.100.66:53", "192.168.1.5:7447", "203.0.113.7:40001"]
    assert vouched_candidates(offered, peer) == ["203.0.113.7:40001", "192.168.1.5:7447"]
    assert vouched_candidates(offered, None) == []


def test_a_private_address_is_dialled_only_where_the_peer_shares_this_nodes_lan():
    local = record("192.168.1.9:7447", observed=("198.51.100.1:7447",))
    elsewhere = record("192.168.7.5:7447", observed=("203.0.113.7:40001",))
    assert worth_dialing(["203.0.113.7:40001", "192.168.7.5:7447"], local, elsewhere) == ["203.0.113.7:40001"]
    same_router = record("10.1.2.3:7447", observed=("198.51.100.1:50000",))
    assert worth_dialing(["10.1.2.3:7447", "198.51.100.1:50000"], local, same_router) == [
        "10.1.2.3:7447",
        "198.51.100.1:50000",
    ]
    public = record("192.168.7.5:7447", reachable=True)
    assert worth_dialing(["192.168.7.5:7447"], local, public) == ["192.168.7.5:7447"]
    assert worth_dialing(["8.8.8.8:7447"], local, record()) == ["8.8.8.8:7447"]
    assert worth_dialing(["203.0.113.7:40001"], local, None) == []


# -- the LAN shortcut ------------------------------------------------------------------------


def test_a_peer_behind_the_same_public_address_is_dialled_at_its_private_addresses():
    local = record("192.168.1.9:7447", observed=("198.51.100.1:7447",))
    peer = record("192.168.1.5:7447", "10.8.0.2:7447", "127.0.0.1:7447", observed=("198.51.100.1:41000",))
    assert lan_addresses(local, peer) == ["192.168.1.5:7447", "10.8.0.2:7447"]


def test_a_peer_announcing_an_address_in_a_private_network_of_ours_is_dialled_there():
    local = record("192.168.1.9:7447")  # no relay observation yet
    assert lan_addresses(local, record("192.168.1.5:7447", "192.168.2.5:7447")) == ["192.168.1.5:7447"]
    assert lan_addresses(record("[fd00:1::9]:7447"), record("[fd00:1::5]:7447")) == ["[fd00:1::5]:7447"]


def test_no_shortcut_to_a_stranger_network_a_public_address_or_a_reachable_peer():
    local = record("192.168.1.9:7447", observed=("198.51.100.1:7447",))
    # Another home numbered like ours: relays see it behind another public address.
    assert lan_addresses(local, record("192.168.1.5:7447", observed=("203.0.113.7:1",))) == []
    assert lan_addresses(local, record("9.9.9.9:7447", observed=("198.51.100.1:2",))) == []
    assert lan_addresses(local, record("192.168.1.5:7447", reachable=True)) == []
    assert lan_addresses(local, None) == []


# -- a link's path -----------------------------------------------------------------------------


def test_a_links_path_is_named_by_how_it_came_about():
    natted = record("192.168.1.5:7447", observed=("203.0.113.7:40001",))
    assert classify_path(relayed=True, remote="", punched=False, peer=natted) is PathKind.RELAYED
    assert classify_path(relayed=False, remote="192.168.1.5:7447", punched=True, peer=natted) is PathKind.LAN
    assert (
        classify_path(relayed=False, remote="203.0.113.7:40001", punched=False, peer=natted)
        is PathKind.PUNCHED
    )
    assert classify_path(relayed=False, remote="203.0.113.9:1", punched=True, peer=natted) is PathKind.PUNCHED
    public = record("198.51.100.2:7447", reachable=True)
    assert (
        classify_path(relayed=False, remote="198.51.100.2:7447", punched=False, peer=public)
        is PathKind.PUBLIC
    )
    assert PathKind.LAN.traversed and PathKind.PUNCHED.traversed
    assert not PathKind.PUBLIC.traversed and not PathKind.RELAYED.traversed
