"""Rounds of disjoint pairs (doctor and `herd bench net`) and naming the node slow links share."""

from __future__ import annotations

from itertools import combinations, permutations

import pytest

from torchherd.preflight.report import Link, shared_slow_node, slow_links
from torchherd.preflight.rounds import both_ways, covering_rounds, pair_rounds


def hosts(count: int) -> list[str]:
    return [f"n{k}" for k in range(count)]


def assert_disjoint(rounds: list[list[tuple[str, str]]]) -> None:
    for pairs in rounds:
        used = [h for pair in pairs for h in pair]
        assert len(used) == len(set(used)), pairs


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 8, 16])
def test_pair_rounds_cover_every_pair_once_without_sharing_a_node(count: int) -> None:
    names = hosts(count)
    rounds = pair_rounds(names)
    seen = [frozenset(pair) for pairs in rounds for pair in pairs]
    assert len(seen) == len(set(seen))
    assert set(seen) == {frozenset(p) for p in combinations(names, 2)}
    assert_disjoint(rounds)
    # N-1 rounds for an even count, N for an odd one: the fewest possible.
    assert len(rounds) == (count - 1 if count % 2 == 0 else count if count > 1 else 0)


def test_pair_rounds_refuse_duplicate_hosts() -> None:
    with pytest.raises(ValueError, match="distinct"):
        pair_rounds(["a", "b", "a"])


@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_both_ways_gives_every_ordered_pair_once(count: int) -> None:
    names = hosts(count)
    rounds = both_ways(pair_rounds(names))
    ordered = [pair for pairs in rounds for pair in pairs]
    assert sorted(ordered) == sorted(permutations(names, 2))
    assert_disjoint(rounds)


@pytest.mark.parametrize("count", [3, 4, 5, 6, 8, 9, 16, 64])
def test_covering_rounds_give_two_partners_in_a_fixed_number_of_rounds(count: int) -> None:
    names = hosts(count)
    rounds = covering_rounds(names)
    assert_disjoint(rounds)
    partners = {h: set() for h in names}
    for pairs in rounds:
        for a, b in pairs:
            partners[a].add(b)
            partners[b].add(a)
    assert all(len(p) >= 2 for p in partners.values()), partners
    # Flat in N: 2 rounds for an even count, 3 for an odd one (each round leaves one out).
    assert len(rounds) == (2 if count % 2 == 0 else 3)


def test_covering_rounds_on_two_nodes_is_their_one_pair() -> None:
    assert covering_rounds(["a", "b"]) == [[("a", "b")]]
    assert covering_rounds(["a"]) == []


def link(src: str, dst: str, gbits: float | None) -> Link:
    return Link(src, dst, "10.0.0.1", 1, "ephemeral", True, gbits=gbits)


def test_the_node_every_slow_link_touches_is_named() -> None:
    links = [
        link("a", "b", 20.0),
        link("a", "c", 0.2),
        link("c", "b", 0.19),
        link("d", "c", 0.21),
        link("a", "d", 18.0),
        link("b", "d", None),  # not measured: ignored
    ]
    assert [x.dst for x in slow_links(links)] == ["b", "c", "c"]
    assert shared_slow_node(links) == "c"


def test_slow_links_split_at_the_widest_gap_however_many_they_are() -> None:
    # A slow node in a 3-node cluster: 4 of the 6 directed links are slow.
    three = [link(a, b, 0.1 if "c" in (a, b) else 5.0) for a in "abc" for b in "abc" if a != b]
    assert len(slow_links(three)) == 4 and shared_slow_node(three) == "c"
    # Noisy healthy links (3.9 to 8.5, as on a busy machine) stay together, the slow ones apart.
    speeds = {("a", "b"): 3.9, ("b", "a"): 5.8, ("a", "d"): 8.0, ("d", "a"): 8.3}
    speeds |= {("b", "d"): 8.2, ("d", "b"): 8.5, ("a", "c"): 1.3, ("c", "a"): 1.4}
    speeds |= {("b", "c"): 1.5, ("c", "b"): 1.6, ("d", "c"): 1.1, ("c", "d"): 1.3}
    noisy = [link(a, b, g) for (a, b), g in speeds.items()]
    assert len(slow_links(noisy)) == 6 and shared_slow_node(noisy) == "c"
    assert slow_links([link("a", "b", 0.0), link("b", "a", 2.0)])[0].gbits == 0.0


def test_no_node_named_when_nothing_is_slow_or_the_blame_is_ambiguous() -> None:
    assert shared_slow_node([link("a", "b", 20.0), link("b", "c", 15.0)]) is None
    assert shared_slow_node([]) is None
    # One slow pair: either end could be the cause.
    assert shared_slow_node([link("a", "b", 0.2), link("b", "a", 0.2), link("c", "d", 9)]) is None
    # Two slow links on different nodes: no single culprit.
    assert shared_slow_node([link("a", "b", 0.2), link("c", "d", 0.2), link("a", "c", 9)]) is None
