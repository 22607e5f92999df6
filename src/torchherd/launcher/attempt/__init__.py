"""One attempt of a job, in the order its data flows:

    request.py  what each node's agent is asked to run (agent_request; ping_every)
    run.py      Attempt: opens the links, sends the requests, runs the parts below,
                freezes the state into outcome.AttemptState when every node is done
    state.py    LiveState: what the running attempt knows (nodes, ranks heard, steps,
                snapshots, how it is ending, what herd found); no I/O
    events.py   AgentEvents: each agent event (and a link's end) -> state changes, the
                judges fed, and what follows (a failed node stops the others)
    watch.py    AttemptWatch: every second, reads the state and the judges (liveness,
                hang) and decides: a stalled launcher, a silent node, a hang
    actions.py  AttemptActions: every command to the agents (stop, kill, save, stacks,
                prewarm, ping), and when the attempt is over

Arrows run one way: run -> events, watch -> actions -> state; nothing here imports run.py.
Beside it in launcher/: slow_ranks.py (the slow-rank watch), teardown.py (how a node is
stopped, cut off and swept), outcome.py (what the frozen state adds up to).
"""

from .request import AGENT_SILENCE, LARGE_JOB_NODES, agent_request, ping_every
from .run import Attempt

__all__ = ["AGENT_SILENCE", "LARGE_JOB_NODES", "Attempt", "agent_request", "ping_every"]
