"""Recovery: how herd notices trouble, what it keeps as evidence, and what it decides.

    detection  liveness.NodeLiveness   a node silent for a few seconds is lost (both ways)
               hang.HangWatch          no progress signal from any rank for too long is a hang
    evidence   evidence.Evidence       every rank's stacks (py-spy), who is behind and why
               causes.explain          known failure signatures -> a cause and a fix, in words
               failures.choose_first_failure   the failure that caused the others
    decisions  policy.RestartPolicy.decide   after an attempt: stop (exit code, reason) or
                                       restart, and on which nodes: one pure function of the
                                       outcome, the nodes at hand, the history, the signals
               nodes.choose_nodes      the next attempt's nodes: in place, a spare, fewer, back

An Attempt (launcher/attempt/) is given the detection and evidence objects (and a clock), the
job loop (launcher/job.py) the policy, so each can be tested alone and swapped.
"""

from .causes import Cause, explain
from .evidence import Behind, Evidence, RankStack
from .hang import HangWatch
from .liveness import NodeLiveness
from .policy import RestartPolicy

__all__ = [
    "Behind",
    "Cause",
    "Evidence",
    "HangWatch",
    "NodeLiveness",
    "RankStack",
    "RestartPolicy",
    "explain",
]
