"""Which relays a node registers with: the stored ones, and the command line's (pure)."""

from __future__ import annotations

from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint
from meshnode.membership.relay_list import RelayList, merge_relays

R1, R2, R3 = (bytes([n]) * 32 for n in (1, 2, 3))


def test_nothing_given_keeps_the_stored_relays_unchanged() -> None:
    stored = [Endpoint(R1, "relay.example:7448")]
    assert merge_relays(stored, []) == RelayList(relays=stored, changes=[])
    assert merge_relays(stored, [Endpoint(R1, "relay.example:7448")]) == RelayList(relays=stored, changes=[])


def test_a_new_relay_is_added_after_the_stored_ones() -> None:
    merged = merge_relays([Endpoint(R1, "a:1")], [Endpoint(R2, "b:2")])
    assert merged.relays == [Endpoint(R1, "a:1"), Endpoint(R2, "b:2")]
    assert merged.changes == [f"added relay {short_id(R2)}@b:2"]


def test_a_relay_given_at_another_address_has_moved_and_keeps_its_place() -> None:
    # Before, the stored address won and the node dialed a relay's old address for good.
    merged = merge_relays([Endpoint(R1, "old:1"), Endpoint(R2, "b:2")], [Endpoint(R1, "new:1")])
    assert merged.relays == [Endpoint(R1, "new:1"), Endpoint(R2, "b:2")]
    assert merged.changes == [f"relay {short_id(R1)} moved from old:1 to new:1"]


def test_a_forgotten_relay_is_dropped_even_when_given_too() -> None:
    stored = [Endpoint(R1, "a:1"), Endpoint(R2, "b:2")]
    merged = merge_relays(stored, [Endpoint(R3, "c:3"), Endpoint(R1, "a:9")], forget={R1, R3})
    assert merged.relays == [Endpoint(R2, "b:2")]
    assert merged.changes == [f"forgot relay {short_id(R1)}@a:1"]
    assert merge_relays(stored, [], forget={R3}) == RelayList(relays=stored, changes=[])
