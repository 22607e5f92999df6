"""The agents' events, turned into what the attempt knows (state.py) and what it does next.

Each node's agent link delivers JSON events (agent/protocol.py lists them): worker lines,
progress beats, phases, snapshots saved, looks and stacks, start marks, "started", "error",
"exit"; and the link itself may end. Each event updates the attempt's ``LiveState`` and feeds
the watches' judges (liveness, hang, slow ranks, evidence); an event that ends a node's share
of the attempt ends the others through the actions (actions.py):
  - a node fails (a worker ended badly: told at once, before torchrun's exit; its workers
    failed; its agent cannot start; its link ends before the agent reported the attempt's
    end): the others are stopped, their stacks taken first;
  - a node's agent stopped because it heard nothing from this launcher: the others too.
A word about another attempt (a late event of the last one) is never acted on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...agent.protocol import missing_module
from ...logs import JobOutput
from ...recovery import Evidence, HangWatch, NodeLiveness
from ...recovery.failures import NodeRun, NodeState
from ...spec import ClusterSpec
from ...startup import node_marks
from ...transport import Transport
from ..links import AgentLink
from ..slow_ranks import SlowRanks
from ..teardown import Teardown
from .actions import AttemptActions
from .state import LiveState


class AgentEvents:
    """One attempt's handler of its agents' events (``handle``) and of a link's end
    (``link_ended``)."""

    def __init__(
        self,
        state: LiveState,
        actions: AttemptActions,
        *,
        cluster: ClusterSpec,
        transport: Transport,
        teardown: Teardown,
        output: JobOutput,
        liveness: NodeLiveness,
        hang: HangWatch,
        slow: SlowRanks,
        evidence: Evidence,
        clock: Callable[[], float] = time.monotonic,
        on_first_step: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.actions = actions
        self.cluster = cluster
        self.transport = transport
        self.teardown = teardown
        self.output = output
        self.liveness = liveness
        self.hang = hang
        self.slow = slow
        self.evidence = evidence
        self.clock = clock
        self.on_first_step = on_first_step
        """Called once every node's ranks made their first step (the start is complete)."""

    def handle(self, node: NodeRun, event: dict[str, Any]) -> None:
        kind = event.get("e")
        host = node.host
        if node.state != NodeState.LOST:
            self.liveness.heard(host)
        if "a" in event and str(event["a"]) != str(self.state.number):
            return  # a late word about another attempt (never expected; never acted on)
        if kind == "lines":
            self.lines(host, event.get("b") or [])
        elif kind == "line":
            self.lines(host, [[event.get("r"), event.get("l"), event.get("s"), event.get("t")]])
        elif kind == "spoke":  # ranks whose lines the node kept: progress all the same
            self._progress(host, {r for r in event.get("r") or [] if isinstance(r, int)})
        elif kind == "beats":
            self.beats(host, event.get("b") or [])
        elif kind == "phase":
            self.hang.phase(event.get("r"), event.get("name"))
        elif kind == "saved":
            self.saved(event)
        elif kind == "look":
            if "id" in event:
                self.slow.looked(host, event, self.clock())
            else:
                self.hang.looked(host, event)
        elif kind == "why-slow":
            self.slow.why(host, event)
        elif kind == "stacks":
            self.evidence.add(host, event)
            self.actions.no_more_stacks_from(host)
        elif kind == "marks":
            self.marks(host, event)
        elif kind == "started":
            if isinstance(event.get("at"), int | float):
                self.state.node_clock[host] = (float(event["at"]), time.monotonic())
            node.state = NodeState.RUNNING
            self.liveness.watch(host)
            self.hang.started()
        elif kind == "error":
            node.error = event
            node.state = NodeState.NOT_STARTED
            self.actions.done(node)
            self.actions.node_failed(node)
        elif kind == "worker-exit":
            self.worker_ended_badly(node)
        elif kind == "exit":
            self.exited(node, event)

    def _progress(self, host: str, ranks: set[int]) -> None:
        """Ranks spoke (lines, sent or kept on their node): alive and making progress."""
        for rank in ranks:
            self.state.spoke(host, rank)
        self.hang.progressed(host, [(rank, None) for rank in ranks])

    def lines(self, host: str, batch: list[Any]) -> None:
        """Worker lines of one node: to the output, and as progress of the ranks that spoke."""
        shown: list[tuple[int | None, str]] = []
        spoke: set[int] = set()
        for item in batch:
            if not isinstance(item, list) or len(item) != 4:
                continue
            rank, text = item[0], str(item[3] or "")
            rank = rank if isinstance(rank, int) else None
            shown.append((rank, text))
            if rank is not None:
                spoke.add(rank)
        self.output.lines(host, shown)
        self._progress(host, spoke)

    def beats(self, host: str, beats: list[Any]) -> None:
        """A node's newest beat of each rank that beat since its last report:
        [rank, step, at, compute, wait, cycle, data] (seconds per step, or None). The node's
        report goes to each judge whole (a thousand nodes report every few seconds)."""
        reported = [
            b for b in beats if isinstance(b, list) and len(b) >= 4 and isinstance(b[0], int)
        ]
        if not reported:
            return
        self.hang.progressed(
            host, [(b[0], b[1] if isinstance(b[1], int) else None) for b in reported]
        )
        self.slow.reported(host, reported)
        self.state.reported(host, reported, self.clock(), time.time())

    def marks(self, host: str, event: dict[str, Any]) -> None:
        """A node's start marks (its agent's StartMarks), placed on this launcher's clock;
        once every node has its first step, ``on_first_step`` is told."""
        state = self.state
        clock = state.node_clock.get(host)
        found = event.get("m")
        if clock is None or not isinstance(found, dict):
            return  # an agent of an older version sends no clock: no marks from it
        state.start_marks[host].update(node_marks(found, *clock))
        if self.on_first_step is not None and all(
            "first-step" in state.start_marks[h] for h in state.nodes
        ):
            told, self.on_first_step = self.on_first_step, None
            told()

    def saved(self, event: dict[str, Any]) -> None:
        rank, at = event.get("r"), event.get("at")
        if not isinstance(rank, int) or not isinstance(at, int | float):
            return
        if self.state.snapshot_saved(rank, float(at)):
            self.output.note(
                f"herd: a snapshot of step {event.get('step')} was committed"
                + (f" ({event['where']})" if event.get("where") else "")
            )

    def worker_ended_badly(self, node: NodeRun) -> None:
        """A worker on the node ended badly, told the moment it did (agent/worker_exits.py):
        the node has failed, and the others are stopped now, while its torchrun still ends
        its other workers. Which rank failed, and how, comes with the node's exit."""
        if node.state == NodeState.RUNNING and not node.done:
            self.actions.node_failed(node)

    def exited(self, node: NodeRun, event: dict[str, Any]) -> None:
        """The node's agent reported the attempt's end there: succeeded, stopped or failed."""
        state = self.state
        host = node.host
        self.liveness.forget(host)
        self.actions.no_more_stacks_from(host)  # an agent that ended sends none
        node.failures = list(event.get("failures", []))
        node.why_stopped = str(event.get("why") or "")
        survivors = [int(p) for p in event.get("survivors") or [] if str(p).isdigit()]
        if survivors:
            state.survivors[host] = survivors
            self.output.note(
                f"herd: {len(survivors)} process(es) of attempt {state.number} outlived the "
                f"kill on {host} (pid {', '.join(map(str, survivors[:5]))}): {host} takes no "
                "further attempt until a sweep finds them gone"
            )
        node.ended_at = time.monotonic()
        if event.get("error"):
            node.error = event["error"] | {"last_stderr": event.get("last_stderr", [])}
        if event.get("code") == 0:
            node.state = NodeState.SUCCEEDED
            self.hang.finished()  # the others' ranks get FINISH_GRACE s to exit too
        elif event.get("stopped"):
            node.state = NodeState.STOPPED
            # Even when the job is already ending: while this launcher was away, the first
            # agent to give up stops its workers, and their peers on other nodes fail on the
            # reset before their own agents give up; whichever exit is read first, the agents
            # stopped this job, and its failures are their consequence.
            if node.why_stopped == "launcher-silent" and not state.interrupted:
                self._agents_stopped_for_silence(node)
        else:
            if not node.failures and node.error is None:
                # torchrun ended badly without a worker failure to show: say how it ended.
                how = event.get("signal") or f"exit code {event.get('code')}"
                node.error = {
                    "message": f"torchrun on {host} ended with {how} and no worker failure",
                    "remedy": f"see {host}'s own lines above, and its torchrun logs in "
                    f"{event.get('node_dir') or 'the job directory on the node'}",
                    "last_stderr": event.get("last_stderr", []),
                }
            node.state = NodeState.FAILED
            self.actions.warm_next_on(host)
            self.actions.node_failed(node)
        self.actions.done(node)

    def _agents_stopped_for_silence(self, node: NodeRun) -> None:
        state = self.state
        if state.stopped_for_silence:
            return  # said once
        state.stopped_for_silence = True
        state.noticed = state.noticed or "the agents heard nothing from this launcher"
        self.output.note(
            f"herd: {node.host}'s agent stopped the job: it heard nothing from this launcher "
            f"for {self.cluster.launcher_silence:g} s (this launcher was stopped, suspended or "
            "starved)"
        )
        if not state.ending:
            self.actions.stop_all()

    def link_ended(self, node: NodeRun, link: AgentLink) -> None:
        """The node's link ended before the agent reported the attempt's end."""
        state = self.state
        stderr = "\n".join(node.stderr)
        spec = self.cluster.node(node.host)
        unreachable = self.transport.classify_failure(spec, node.exit_code or 0, stderr)
        if unreachable is not None and not stderr.strip():
            # ssh says nothing of its own when the remote command was killed (exit 255 and
            # no words): the link worked, the agent died. The node answers: sweep it.
            unreachable = None
        self.liveness.forget(node.host)
        self.actions.no_more_stacks_from(node.host)
        if missing_module(stderr) == "torchherd":
            node.error = {
                "message": f"torchherd is not installed for {node.plan.python} on {node.host}",
                "remedy": "install it there (`herd exec -- pip install torchherd`), "
                "or point python at an environment that has it",
            }
            node.state = NodeState.NOT_STARTED
        elif link.cut_off:
            if node.state != NodeState.LOST:
                node.state = NodeState.STOPPED
            self.teardown.sweep_later(node.plan)
        elif state.stopping and node.state == NodeState.STARTING:
            node.state = NodeState.STOPPED
        else:
            detail = (
                unreachable.describe() if unreachable else f"agent exited with {node.exit_code}"
            )
            node.error = {
                "message": f"lost contact with {node.host} ({detail})",
                "remedy": unreachable.remedy if unreachable else "see the node's lines above",
                "last_stderr": list(node.stderr),
            }
            node.state = NodeState.STOPPED if state.stopping and not unreachable else NodeState.LOST
            if unreachable is None:
                # The agent died but the node answers: end what it left behind there.
                self.teardown.sweep_later(node.plan)
        self.actions.done(node)
        self.actions.node_failed(node)
