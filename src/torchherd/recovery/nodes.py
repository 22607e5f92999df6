"""The next attempt's nodes: the same ones in place, fewer, a spare in a lost node's place, or
the ones that came back. Pure functions over host names; the job (job.py) gathers the facts.

    in place   no node was lost and every agent reported the attempt's end: the same nodes,
               through the same agents
    spare      a lost node's place goes to a spare with as many workers (warm, never used):
               the world size stays the same, so a job resumes exactly as if nothing happened
    fewer      lost nodes without a spare are left out when at least ``min_nodes`` remain
               (the first node left hosts the rendezvous); each is swept before it is used
               again
    grown      nodes that were left out and came back (they answer, were swept, pass a
               launch's checks: pool.joining_problems) join again, up to the cluster's own
               node count; a node that comes back while the world is full becomes a spare

recovery.policy.RestartPolicy.decide calls this: which nodes are "lost" there includes nodes
whose end is unconfirmed and nodes set aside for failing attempts in a row.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeChoice:
    """The next attempt's nodes and why they differ from the last attempt's."""

    nodes: tuple[str, ...]
    """In the cluster's order; the first hosts the rendezvous."""
    left_out: tuple[str, ...] = ()
    """Lost nodes the job goes on without."""
    replaced: tuple[tuple[str, str], ...] = ()
    """(lost node, the spare in its place)."""
    added: tuple[str, ...] = ()
    """Nodes that came back and join again."""
    waiting: tuple[str, ...] = ()
    """Lost nodes the job cannot go on without (too few would remain): wait for them."""
    notes: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.left_out or self.replaced or self.added)

    def describe(self) -> str:
        """One line for the console and the job record ("" when nothing changed)."""
        parts = [f"spare {spare} takes {lost}'s place" for lost, spare in self.replaced]
        if self.left_out:
            parts.append(f"going on without {', '.join(self.left_out)}")
        if self.added:
            parts.append(f"{', '.join(self.added)} back in the job")
        if not parts:
            return ""
        return f"{'; '.join(parts)}: {len(self.nodes)} node(s), rendezvous on {self.nodes[0]}"


def choose_nodes(
    order: Sequence[str],
    current: Sequence[str],
    lost: Collection[str],
    *,
    nproc: Mapping[str, int],
    spares: Sequence[str] = (),
    returned: Sequence[str] = (),
    min_nodes: int | None = None,
    size: int | None = None,
) -> NodeChoice:
    """The next attempt's nodes.

    ``order``: every node of the cluster in its order; ``current``: the last attempt's nodes;
    ``lost``: those that may not be used as they are; ``nproc``: workers per node;
    ``spares``: idle spares ready to take a place; ``returned``: left-out nodes ready to join
    again; ``min_nodes``: fewest nodes to go on with (None: every node of ``size``);
    ``size``: the job's full node count (default: ``current``'s)."""
    size = size or len(current)
    needed = size if min_nodes is None else min(min_nodes, size)
    kept = [h for h in current if h not in lost]
    free_spares = [s for s in spares if s not in current]
    replaced: list[tuple[str, str]] = []
    left_out: list[str] = []
    for host in (h for h in current if h in lost):
        spare = next((s for s in free_spares if nproc.get(s) == nproc.get(host)), None)
        if spare is None:
            left_out.append(host)
            continue
        free_spares.remove(spare)
        replaced.append((host, spare))
        kept.append(spare)
    added = [h for h in returned if h not in kept][: max(0, size - len(kept))]
    kept += added
    if len(kept) < max(1, needed):
        return NodeChoice(tuple(current), waiting=tuple(left_out), replaced=tuple(replaced))
    arranged = tuple(h for h in order if h in kept)
    return NodeChoice(arranged, tuple(left_out), tuple(replaced), tuple(added))
