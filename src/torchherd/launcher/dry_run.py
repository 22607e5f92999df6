"""`herd launch --dry-run` where the nodes cannot all be probed: the plan made offline.

A dry run probes every node as a launch does (over ssh: is it there, which address reaches
it, how many GPUs, a free port), so what it prints is what would run. Where a node cannot be
reached yet (hosts being set up, a laptop away from the cluster), the plan is still made, from
the cluster file alone: each node's address is a placeholder from 192.0.2.0/24 (RFC 5737's
documentation range, never a real host), the rendezvous port is 29500 unless rdzv_port is set,
and each node runs ``--nproc`` workers (else the cluster's nproc, else one). The plan says so,
and why, in notes that the text and ``--json`` both carry. Hot spares (``spare = true``,
``--spares N``) take no rank in either plan: a note names them.
"""

from __future__ import annotations

import dataclasses

from ..facts import NodeFacts
from ..plan import JobSpec, LaunchPlan, make_plan
from ..spec import ClusterSpec

PLACEHOLDER_NET = "192.0.2."
PLACEHOLDER_PORT = 29500


def offline_plan(cluster: ClusterSpec, job: JobSpec, why: str) -> LaunchPlan:
    """The plan from the cluster alone, with placeholders where the nodes would answer, and
    notes that say which and why (``why``: what stopped the probe)."""
    cluster = cluster.with_spares(job.spares)
    spares = spare_notes(cluster)
    cluster = cluster.select(n.host for n in cluster.active)
    nodes, stand_ins = [], []
    for index, node in enumerate(cluster.nodes):
        if node.addr is None and cluster.transport != "local":
            placeholder = f"{PLACEHOLDER_NET}{index + 1}"
            stand_ins.append(f"{placeholder} stands for {node.host}'s address")
            node = node.model_copy(update={"addr": placeholder})
        nodes.append(node)
    offline = cluster.model_copy(update={"nodes": tuple(nodes)})
    facts = {
        # cores unknown: one a worker, so no crowding is made up and OMP_NUM_THREADS stays 1
        n.host: NodeFacts(
            host=n.host,
            port=cluster.rdzv_port or PLACEHOLDER_PORT,
            cpu_count=max(job.nproc or 0, n.nproc or 0, 1),
        )
        for n in offline.nodes
    }
    plan = make_plan(offline, job, facts)
    lines = why.strip().splitlines()
    first_line = lines[0].rstrip(":") if lines else "the nodes did not answer"
    notes = [
        f"made offline, without the nodes ({first_line}): a launch probes every node first",
        *stand_ins,
        *spares,
    ]
    if not cluster.rdzv_port and cluster.transport != "local":
        notes.append(f"port {PLACEHOLDER_PORT} stands for a free port the launch finds")
    if job.nproc is None:
        notes.append("worker counts assume no GPUs where the cluster file gives no nproc")
    return dataclasses.replace(plan, notes=(*plan.notes, *notes))


def spare_notes(cluster: ClusterSpec) -> list[str]:
    """A note per hot spare of ``cluster`` (spares applied): the plan leaves it out."""
    return [
        f"{node.host} is a hot spare: it takes no rank, and takes a lost node's place"
        for node in cluster.spares
    ]
