"""A node joining a running job (a spare, a node back) passes a launch's checks, judged
against the job's nodes (pool.joining_problems), over recorded probe facts."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_plan import facts
from torchherd.facts import NodeFacts
from torchherd.launcher.pool import joining_problems
from torchherd.spec import ClusterSpec, NodeSpec

CLUSTER = ClusterSpec(nodes=tuple(NodeSpec(host=h, nproc=1) for h in ("n1", "n2", "n3")))


def node(host: str, torch: str = "2.13.0", gpus: int = 0) -> NodeFacts:
    n = int(host[1:])
    found = facts(host, [("eth0", f"10.0.0.{n}", 24)], ssh_addr=f"10.0.0.{n}", gpus=gpus)
    return replace(found, torch_version=torch)


def test_a_version_tie_blames_the_node_that_joins_not_the_job() -> None:
    """n1 comes back to a job running on n2 alone, with another torch: one against one, and
    n1 comes first in the cluster's order; n1 is the odd one out all the same."""
    known = {"n1": node("n1"), "n2": node("n2")}
    problems = joining_problems(CLUSTER, known, ["n2"], "n1", node("n1", torch="2.12.0"))
    assert problems and problems[0].startswith("n1: torch 2.12.0 here, 2.13.0 on n2"), problems


def test_the_majority_of_the_job_is_the_reference() -> None:
    known = {h: node(h) for h in ("n1", "n2", "n3")}
    assert joining_problems(CLUSTER, known, ["n2", "n3"], "n1", node("n1")) == []
    odd = joining_problems(CLUSTER, known, ["n2", "n3"], "n1", node("n1", torch="2.14.0"))
    assert odd and "torch 2.14.0 here, 2.13.0 on n2, n3" in odd[0]


def test_a_node_back_with_fewer_gpus_cannot_join() -> None:
    known = {"n1": node("n1", gpus=4), "n2": node("n2", gpus=4)}
    problems = joining_problems(CLUSTER, known, ["n2"], "n1", node("n1", gpus=3))
    assert problems == [
        "n1: 3 GPU(s) now, 4 when the job started; fix: look at the node's GPUs "
        "(nvidia-smi), or leave it out of the cluster"
    ]


def test_a_node_back_without_the_script_cannot_join() -> None:
    known = {"n1": node("n1"), "n2": node("n2")}
    back = replace(
        node("n1"), entry={"script": "train.py", "found": False}, workdir="/w", workdir_exists=True
    )
    problems = joining_problems(CLUSTER, known, ["n2"], "n1", back)
    assert problems and "train.py" in problems[0], problems
