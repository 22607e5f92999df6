"""Rounds of disjoint node pairs, for throughput tests that do not share a NIC.

Measuring one link at a time makes a network test grow with the number of pairs; measuring
every link at once makes links share NICs and report a fraction of their speed. Rounds of
disjoint pairs (no node twice in a round) run each round's links together, so a full matrix
takes N-1 rounds (N with an odd N), and a sample that covers every node takes a fixed few.
Pure functions of host names; the doctor and `herd bench net` both schedule with them.
"""

from __future__ import annotations

from collections.abc import Sequence

Pair = tuple[str, str]
Round = list[Pair]


def pair_rounds(hosts: Sequence[str]) -> list[Round]:
    """Every unordered pair once, in rounds where no host appears twice (the circle method).

    The first host stays put while the others rotate around it; an odd count gets a bye
    (None) so one host sits each round out.
    """
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts must be distinct: {list(hosts)}")
    ring: list[str | None] = list(hosts) + ([None] if len(hosts) % 2 else [])
    rounds: list[Round] = []
    for _ in range(len(ring) - 1):
        half = len(ring) // 2
        pairs = [(ring[i], ring[-1 - i]) for i in range(half)]
        found = [(a, b) for a, b in pairs if a is not None and b is not None]
        if found:
            rounds.append(found)
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def both_ways(rounds: Sequence[Round]) -> list[Round]:
    """Each round followed by the same pairs reversed: every ordered pair once, still disjoint."""
    out: list[Round] = []
    for pairs in rounds:
        out.append(list(pairs))
        out.append([(b, a) for a, b in pairs])
    return out


def covering_rounds(hosts: Sequence[str], partners: int = 2) -> list[Round]:
    """The first rounds of `pair_rounds` that give every host ``partners`` distinct partners
    (or all rounds, where there are fewer hosts). With two partners each, a slow node is on
    two slow links and its partners on one each, so the node the slow links share names it.
    The count of rounds depends on ``partners``, not on the number of hosts."""
    rounds = pair_rounds(hosts)
    seen = {host: 0 for host in hosts}
    chosen: list[Round] = []
    for pairs in rounds:
        if all(count >= partners for count in seen.values()):
            break
        chosen.append(pairs)
        for a, b in pairs:
            seen[a] += 1
            seen[b] += 1
    return chosen
