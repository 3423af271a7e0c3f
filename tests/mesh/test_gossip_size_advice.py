"""A full-gossip node says when its mesh has outgrown full gossip, once per doubling."""

from meshnode.mesh.gossip_size_advice import FULL_GOSSIP_ADVISED_MEMBERS, FullGossipAdvice


def test_a_small_mesh_is_told_nothing() -> None:
    advice = FullGossipAdvice()
    assert all(advice.at_beat(n) is None for n in range(FULL_GOSSIP_ADVISED_MEMBERS + 1))


def test_the_warning_names_the_size_and_the_fix_once_per_doubling() -> None:
    advice = FullGossipAdvice(threshold=64)
    warned = {n: advice.at_beat(n) for n in range(60, 300)}
    said = {n: text for n, text in warned.items() if text is not None}
    assert sorted(said) == [65, 129, 257]
    assert "65 members" in said[65] and "--gossip delta" in said[65]


def test_a_jump_past_several_steps_warns_once_and_waits_for_the_next_doubling() -> None:
    advice = FullGossipAdvice(threshold=64)
    assert advice.at_beat(300) is not None
    assert advice.at_beat(500) is None
    assert advice.at_beat(513) is not None


def test_a_shrinking_mesh_is_not_warned_again_until_it_passes_a_new_step() -> None:
    advice = FullGossipAdvice(threshold=64)
    assert advice.at_beat(70) is not None
    assert advice.at_beat(40) is None
    assert advice.at_beat(70) is None
