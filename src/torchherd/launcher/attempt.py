"""One attempt of a job: a plan run on its nodes through their agent links, watched, ended.

Node states (recovery.failures.NodeRun):
              starting -> running -> succeeded | failed | stopped | lost
              starting -> not started            (the agent could not start the attempt)

The attempt is over when every node is done with it: its agent reported the attempt's exit,
or its link ended, or herd cut it off. What ends it early:
  - a node fails (its workers failed) or its agent's link ends: the others are stopped, since
    their workers would wait in a collective or a rendezvous that can never complete;
  - a node goes silent (not even its 2-s "alive" for [cluster] link_silence, 10 s, while this
    launcher was there to hear): it is lost ("stopped answering at ..."), its link is cut;
    unless the other nodes' ranks still step after its last word (its ranks take part in
    their collectives): then a quiet link alone loses it only past launcher_silence;
  - a hang (recovery.hang: silence makes herd look at the ranks; the evidence decides);
  - ``interrupt()`` (Ctrl-C, SIGTERM, SIGHUP) or a time limit (``request_save``).
Before herd stops workers that are not ending by themselves it takes their stacks: every node's
agent dumps its workers, then stops them (for a hang, every node's stacks first, then the
stop). A stopping node keeps saying "alive"; one whose agent has not reported the attempt's
end within the grace period plus the agent's teardown budget is cut off and then swept (an
attempt-scoped stop run through a new session), so no process of this attempt outlives it
unnoticed and the next attempt never meets it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..agent.protocol import missing_module
from ..logs import FLUSH_EVERY, JobOutput
from ..plan import LaunchPlan, NodePlan
from ..recovery import Evidence, HangWatch, NodeLiveness
from ..recovery.failures import NodeRun, NodeState, choose_first_failure, in_words
from ..recovery.liveness import SILENCE, LauncherClock, steps_vouch_for
from ..recovery.straggler import Slow
from ..results import Failure
from ..spec import ClusterSpec
from ..startup import node_marks
from ..transport import Transport
from .links import AgentLink
from .outcome import AttemptResult, AttemptState, result_of
from .slow_ranks import SlowRanks
from .teardown import Teardown

# Seconds between pings to each agent: at least this often, and often enough that an agent
# hears the launcher PINGS_PER_SILENCE times within its launcher_silence (at most this rarely).
HEARTBEAT_INTERVAL = 2.0
PINGS_PER_SILENCE = 9
LONGEST_PING_GAP = 10.0
# Above this many nodes a job is large: the agents send the console only rank 0's lines and
# every rank's stderr (every line is kept on its node: herd logs JOB --rank R fetches it
# there), and each reports its ranks' progress every LARGE_JOB_REPORT_EVERY s, not every
# second: a report is one event, and events are the launcher's steady work per node.
LARGE_JOB_NODES = 16
LARGE_JOB_REPORT_EVERY = 3.0
# Seconds of silence from the launcher after which an agent ends its attempt (by default;
# [cluster] launcher_silence): a launcher that was stopped, suspended or blocked for up to a
# minute finds its job still running.
AGENT_SILENCE = 90.0
# Seconds herd waits for every node's stacks before it stops a hung job.
EVIDENCE_TIMEOUT = 30.0
# Seconds between looks for silent nodes, stalls, deadlines and hangs.
WATCH_EVERY = 1.0


def agent_request(
    plan: LaunchPlan,
    node: NodePlan,
    silence: float = AGENT_SILENCE,
    send: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request an agent runs an attempt from; `herd launch --detach` sends it too.
    ``silence``: seconds without a word from the launcher before the agent stops the job;
    ``send``: which worker lines to send (None: all; else ``{"ranks": [...], "stderr": bool}``,
    the rest kept on the node)."""
    request: dict[str, Any] = {
        "job_id": plan.job_id,
        "node": node.name,
        "workdir": plan.workdir,
        "argv": list(node.argv),
        "env": dict(node.env),
        "secret_env": dict(plan.secret_env),
        "grace": plan.grace,
        "heartbeat": HEARTBEAT_INTERVAL,
        "silence": silence,
        "report_every": LARGE_JOB_REPORT_EVERY if len(plan.nodes) > LARGE_JOB_NODES else 1.0,
        "serve": True,  # the agent stays for the job's next attempt (a restart in place)
    }
    if send is not None:
        request["send"] = send
    return request


def ping_every(launcher_silence: float) -> float:
    """Seconds between the launcher's pings to each agent. Pings only keep an agent from
    taking the launcher for gone (its launcher_silence, 90 s by default): on a large job a ping
    every 2 s to every node would be most of the launcher's steady work."""
    return min(max(HEARTBEAT_INTERVAL, launcher_silence / PINGS_PER_SILENCE), LONGEST_PING_GAP)


class Attempt:
    def __init__(
        self,
        plan: LaunchPlan,
        cluster: ClusterSpec,
        transport: Transport,
        output: JobOutput,
        links: dict[str, AgentLink],
        *,
        number: int = 0,
        hang: HangWatch | None = None,
        silence: float = SILENCE,
        evidence_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        prewarm_next: bool = False,
        on_slow: Callable[[Slow], None] | None = None,
        send: dict[str, Any] | None = None,
        on_first_step: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.transport = transport
        self.output = output
        output.attempt_started()
        self.links = links
        """The job's links by host, shared: new ones are added, ended ones stay (ended)."""
        self.number = number
        self.nodes = {p.host: NodeRun(p) for p in plan.nodes}
        self.hang = hang if hang is not None else HangWatch(clock=clock)
        self.hang.world_size = plan.world_size
        self.liveness = NodeLiveness(self.nodes, silence=silence, clock=clock)
        self.silence = silence
        self.evidence = Evidence(evidence_dir or output.log_dir / "stacks" / f"attempt-{number}")
        self.prewarm_next = prewarm_next
        """Warm a wrapper for the next attempt on every node while this one stops."""
        self.send = send
        """Which worker lines the agents send (None: all; see agent_request)."""
        self.cause: Failure | None = None
        """Set when herd itself found the cause (a lost node, a hang); wins over workers'."""
        self.hang_found: str | None = None
        self.never_exited = False
        """The job's work finished, but a rank never exited (herd ended it)."""
        self.behind: tuple[str, ...] = ()
        self.noticed: str | None = None
        """How herd noticed what ended the attempt early, in words (for the job's story)."""
        self.trigger: str | None = None
        """The node whose failure made the attempt stop the others."""
        self.ranks_seen: set[tuple[str, int]] = set()
        self.node_steps: dict[str, list[tuple[float, int]]] = {}
        """host -> [(when, step) first seen, (when, step) latest]: the node's step rate."""
        self.survivors: dict[str, list[int]] = {}
        """host -> processes of this attempt that outlived its agent's kill there: the node
        stays out of an in-place restart until a sweep finds them gone."""
        self.stepped_at: dict[str, float] = {}
        """host -> when (this launcher's clock) its ranks' step last went up."""
        self.quiet_said: set[str] = set()
        self.stopping = False
        self.interrupted = False
        self.saving = False
        self._save_asked_at: float | None = None
        self._saved_before: dict[int, float] = {}
        self.saved_after_request = False
        self.saves = 0
        """Committed snapshots the workers reported (the job can save on request)."""
        self.growing = ""
        """Why the workers were asked to save and stop to grow the job, if they were."""
        self.stopped_for_silence = False
        """The agents stopped the attempt because this launcher had gone silent."""
        self._ending = False
        self.start_marks: dict[str, dict[str, float]] = {h: {} for h in self.nodes}
        """host -> its start's marks on this launcher's clock (startup.py): the run request
        sent, then its agent's marks from the wrapper's warm-up to the first step."""
        self._node_clock: dict[str, tuple[float, float]] = {}
        """host -> (its "started" event's time on the node, its arrival here)."""
        self.on_first_step = on_first_step
        """Called once every node's ranks made their first step (the start is complete)."""
        self.ending_at: float | None = None
        """When this launcher first saw the attempt end (a node done, a stop asked): a
        restart's start is counted from here."""
        self.teardown = Teardown(plan, cluster, transport, links, output, clock)
        self._stacks_wanted: set[str] = set()
        self._stacks_arrived = asyncio.Event()
        self._done = asyncio.Event()
        self._clock = clock
        self.slow = SlowRanks(
            links,
            lambda: [
                h for h, n in self.nodes.items() if n.state == NodeState.RUNNING and not n.done
            ],
            self.hang.silent_for,
            plan.world_size,
            output.note,
            on_slow,
        )

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> AttemptResult:
        started = time.monotonic()
        openers = [asyncio.create_task(self._start_node(node)) for node in self.nodes.values()]
        helpers = [
            asyncio.create_task(self._ping_agents()),
            asyncio.create_task(self._flush_output()),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self.slow.run()),
        ]
        try:
            await asyncio.gather(*openers)
            self._check_done()
            await self._done.wait()
            await self.teardown.finish_sweeps()
        finally:
            for task in [*helpers, *openers]:
                task.cancel()
            for node in self.nodes.values():
                link = self.links.get(node.host)
                if link is not None and link.on_event is not None:
                    link.on_event = None
                    link.on_text = None
        return await asyncio.to_thread(result_of, self.ended_state(), time.monotonic() - started)

    async def _start_node(self, node: NodeRun) -> None:
        link = self.links.get(node.host)
        if link is None or not link.alive:
            try:
                link = await AgentLink.open(
                    self.transport, self.cluster, self.cluster.node(node.host)
                )
            except OSError as exc:
                node.error = {"message": f"cannot start the agent: {exc}", "remedy": ""}
                self._set_state(node, NodeState.NOT_STARTED)
                self._mark_done(node)
                return
            self.links[node.host] = link
        link.on_event = lambda event, n=node: self._handle(n, event)
        link.on_text = lambda text, n=node: self.output.line(n.host, None, text)
        link.start_reading()
        self.start_marks[node.host]["requested"] = time.monotonic()
        link.run(agent_request(self.plan, node.plan, self.cluster.launcher_silence, self.send))
        if self.stopping:
            self._tell_stop(node)
        asyncio.create_task(self._watch_link(node, link))

    async def _watch_link(self, node: NodeRun, link: AgentLink) -> None:
        await link.ended.wait()
        if not node.done:
            node.exit_code = link.exit_code
            node.stderr.extend(link.stderr)
            node.ended_at = time.monotonic()
            self._link_lost(node, link)

    # -- control --------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop every node; a second one kills every worker at once."""
        if self.interrupted:
            self.kill_all()
            return
        self.interrupted = True
        self.output.note("herd: stopping the job on every node (Ctrl-C again to kill it now)")
        self.stop_all()

    def kill_all(self) -> None:
        """Kill every worker now (no grace, no stacks); cut the links that do not confirm."""
        if self.teardown.killing:
            return
        self._ending_seen()
        self._ending = True
        self.stopping = True
        self.output.verdict_given()
        self.output.note("herd: killing the job on every node")
        self.teardown.kill([h for h, node in self.nodes.items() if not node.done])

    def request_save(self, within: float, grow: str = "") -> None:
        """Ask every worker to save a snapshot and stop (torchherd.train does at its next log
        step); whatever still runs after ``within`` seconds is stopped. ``grow``: why (nodes
        came back: the next attempt has a larger world), else a time limit."""
        if self.saving or self.stopping:
            return
        self._ending_seen()
        self.saving = True
        self.growing = grow
        self._save_asked_at = time.time()
        self.output.note(
            (f"herd: {grow}: " if grow else "herd: ")
            + f"asking every worker to save a snapshot and stop (stopping in {within:g} s "
            "at the latest)"
        )
        for node in self.nodes.values():
            link = self.links.get(node.host)
            if link is not None:
                link.command("save", attempt=self.number)
        asyncio.get_running_loop().call_later(within, self.stop_all)

    def stop_all(self, except_host: str | None = None, *, stacks: bool = False) -> None:
        """Stop every node (with ``stacks``, each takes its workers' stacks first)."""
        self._ending_seen()
        self._ending = True
        self.stopping = True
        self.output.verdict_given()
        for host, node in self.nodes.items():
            if host != except_host:
                self._tell_stop(node, stacks=stacks)

    @property
    def attempt_to_warm(self) -> int | None:
        """The next attempt, when one may come: its wrapper is warmed as this one ends."""
        return self.number + 1 if self.prewarm_next else None

    def _tell_stop(self, node: NodeRun, stacks: bool = False) -> None:
        if node.done:
            return
        self.teardown.stop(node.host, stacks=stacks, next_attempt=self.attempt_to_warm)

    def end_with_evidence(self, except_host: str | None = None, *, gather: bool = False) -> None:
        """Stop every node after its workers' stacks are taken: each node's own before its
        stop (a failure, a lost node), or every node's before any stop (``gather``: a hang,
        where the stacks must show the job as it hung)."""
        if self._ending:
            return
        self._ending_seen()
        self._ending = True
        if not gather:
            if any(not n.done and h != except_host for h, n in self.nodes.items()):
                self.output.note("herd: taking the workers' stacks as the other nodes stop")
            self.stop_all(except_host, stacks=True)
            return
        asyncio.get_running_loop().create_task(self._gather_then_stop(except_host))

    async def _gather_then_stop(self, except_host: str | None) -> None:
        try:
            await self.gather_stacks()
        finally:
            self.stop_all(except_host)

    async def gather_stacks(self, timeout: float = EVIDENCE_TIMEOUT) -> None:
        """Ask every running agent for its workers' stacks; wait for them (at most timeout)."""
        live = [n for n in self.nodes.values() if n.state == NodeState.RUNNING and not n.done]
        self._stacks_wanted = {n.host for n in live}
        if not live:
            return
        self.output.note(
            f"herd: taking the workers' stacks on {len(live)} node(s) before stopping the job"
        )
        self._stacks_arrived.clear()
        for node in live:
            link = self.links.get(node.host)
            if link is not None:
                link.command("stacks", attempt=self.number)
        try:
            await asyncio.wait_for(self._stacks_arrived.wait(), timeout)
        except TimeoutError:
            missing = ", ".join(sorted(self._stacks_wanted))
            self.evidence.problems.append(f"no stacks from {missing} within {timeout:g} s")

    # -- events ---------------------------------------------------------------------------------

    def _handle(self, node: NodeRun, event: dict[str, Any]) -> None:
        kind = event.get("e")
        host = node.host
        if node.state != NodeState.LOST:
            self.liveness.heard(host)
        if "a" in event and str(event["a"]) != str(self.number):
            return  # a late word about another attempt (never expected; never acted on)
        if kind == "lines":
            self._lines(host, event.get("b") or [])
        elif kind == "line":
            self._lines(host, [[event.get("r"), event.get("l"), event.get("s"), event.get("t")]])
        elif kind == "spoke":  # ranks whose lines the node kept: progress all the same
            for rank in event.get("r") or []:
                if isinstance(rank, int):
                    self.ranks_seen.add((host, rank))
                    self.hang.seen(host, rank)
                    self.hang.signal(rank)
        elif kind == "beats":
            self._beats(host, event.get("b") or [])
        elif kind == "phase":
            self.hang.phase(event.get("r"), event.get("name"))
        elif kind == "saved":
            self._saved(event)
        elif kind == "look":
            if "id" in event:
                self.slow.looked(host, event, self._clock())
            else:
                self.hang.looked(host, event)
        elif kind == "why-slow":
            self.slow.why(host, event)
        elif kind == "stacks":
            self.evidence.add(host, event)
            self._no_more_stacks_from(host)
        elif kind == "marks":
            self._marks(host, event)
        elif kind == "started":
            if isinstance(event.get("at"), int | float):
                self._node_clock[host] = (float(event["at"]), time.monotonic())
            self._set_state(node, NodeState.RUNNING)
            self.liveness.watch(host)
            self.hang.started()
        elif kind == "error":
            node.error = event
            self._set_state(node, NodeState.NOT_STARTED)
            self._mark_done(node)
            self._on_node_failed(node)
        elif kind == "exit":
            self._exited(node, event)

    def _marks(self, host: str, event: dict[str, Any]) -> None:
        """A node's start marks (its agent's StartMarks), placed on this launcher's clock;
        once every node has its first step, ``on_first_step`` is told."""
        clock = self._node_clock.get(host)
        found = event.get("m")
        if clock is None or not isinstance(found, dict):
            return  # an agent of an older version sends no clock: no marks from it
        self.start_marks[host].update(node_marks(found, *clock))
        if self.on_first_step is not None and all(
            "first-step" in self.start_marks[h] for h in self.nodes
        ):
            told, self.on_first_step = self.on_first_step, None
            told()

    def _beats(self, host: str, beats: list[Any]) -> None:
        """A node's newest beat of each rank that beat since its last report:
        [rank, step, at, compute, wait, cycle, data] (seconds per step, or None)."""
        for item in beats:
            if not isinstance(item, list) or len(item) < 4:
                continue
            rank, step, at, compute, *timings = item
            if not isinstance(rank, int):
                continue
            self.hang.seen(host, rank)
            self.hang.signal(rank, step if isinstance(step, int) else None)
            self.slow.computed(host, rank, compute)
            self.slow.timed(host, rank, *(timings + [None, None, None])[:3])
            self._stepped(host, step, at)

    def _stepped(self, host: str, step: object, at: object) -> None:
        """A node's first and latest step, and when (its step rate, for the job's story).
        When is the beat's own time, not its arrival: a node's events can arrive in bursts."""
        if isinstance(step, int) and isinstance(at, int | float):
            latest = self.node_steps.get(host, [(at, -1), (at, -1)])[1][1]
            if step > latest:
                self.stepped_at[host] = self._clock()
            first = self.node_steps.setdefault(host, [(at, step), (at, step)])[0]
            self.node_steps[host] = [first, (at, max(step, self.node_steps[host][1][1]))]

    def step_rates(self) -> dict[str, tuple[int, float | None]]:
        """host -> (latest step, steps per second over the attempt, when known)."""
        rates: dict[str, tuple[int, float | None]] = {}
        for host, ((t0, s0), (t1, s1)) in self.node_steps.items():
            # Beats are sampled (one per half second at most): one step seen is no rate.
            known = t1 - t0 >= 1.0 and s1 > s0
            rates[host] = (s1, (s1 - s0) / (t1 - t0) if known else None)
        return rates

    def _lines(self, host: str, batch: list[Any]) -> None:
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
        for rank in spoke:
            self.ranks_seen.add((host, rank))
            self.hang.seen(host, rank)
            self.hang.signal(rank)

    def _exited(self, node: NodeRun, event: dict[str, Any]) -> None:
        host = node.host
        self.liveness.forget(host)
        self._no_more_stacks_from(host)  # an agent that ended sends none
        node.failures = list(event.get("failures", []))
        node.why_stopped = str(event.get("why") or "")
        survivors = [int(p) for p in event.get("survivors") or [] if str(p).isdigit()]
        if survivors:
            self.survivors[host] = survivors
            self.output.note(
                f"herd: {len(survivors)} process(es) of attempt {self.number} outlived the kill "
                f"on {host} (pid {', '.join(map(str, survivors[:5]))}): {host} takes no "
                "further attempt until a sweep finds them gone"
            )
        node.ended_at = time.monotonic()
        if event.get("error"):
            node.error = event["error"] | {"last_stderr": event.get("last_stderr", [])}
        if event.get("code") == 0:
            self._set_state(node, NodeState.SUCCEEDED)
            self.hang.finished()  # the others' ranks get FINISH_GRACE s to exit too
        elif event.get("stopped"):
            self._set_state(node, NodeState.STOPPED)
            # Even when the job is already ending: while this launcher was away, the first
            # agent to give up stops its workers, and their peers on other nodes fail on the
            # reset before their own agents give up; whichever exit is read first, the agents
            # stopped this job, and its failures are their consequence.
            if node.why_stopped == "launcher-silent" and not self.interrupted:
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
            self._set_state(node, NodeState.FAILED)
            self._warm_next_on(host)
            self._on_node_failed(node)
        self._mark_done(node)

    def _warm_next_on(self, host: str) -> None:
        """A failed node's agent stays for the next attempt (in place): have it warm that
        attempt's wrapper now, as the other nodes do while they stop, so it does not join the
        next rendezvous last, importing torch."""
        link = self.links.get(host)
        if self.attempt_to_warm is not None and link is not None:
            link.command("prewarm", attempt=self.attempt_to_warm)

    def _saved(self, event: dict[str, Any]) -> None:
        rank, at = event.get("r"), event.get("at")
        if not isinstance(rank, int) or not isinstance(at, int | float):
            return
        self.saves += 1
        if self._save_asked_at is None:
            self._saved_before[rank] = float(at)
        elif float(at) != self._saved_before.get(rank):
            self.saved_after_request = True
            self.output.note(
                f"herd: a snapshot of step {event.get('step')} was committed"
                + (f" ({event['where']})" if event.get("where") else "")
            )

    def _agents_stopped_for_silence(self, node: NodeRun) -> None:
        if self.stopped_for_silence:
            return  # said once
        self.stopped_for_silence = True
        self.noticed = self.noticed or "the agents heard nothing from this launcher"
        self.output.note(
            f"herd: {node.host}'s agent stopped the job: it heard nothing from this launcher "
            f"for {self.cluster.launcher_silence:g} s (this launcher was stopped, suspended or "
            "starved)"
        )
        if not self._ending:
            self.stop_all()

    def _link_lost(self, node: NodeRun, link: AgentLink) -> None:
        """The node's link ended before the agent reported the attempt's end."""
        stderr = "\n".join(node.stderr)
        spec = self.cluster.node(node.host)
        unreachable = self.transport.classify_failure(spec, node.exit_code or 0, stderr)
        if unreachable is not None and not stderr.strip():
            # ssh says nothing of its own when the remote command was killed (exit 255 and
            # no words): the link worked, the agent died. The node answers: sweep it.
            unreachable = None
        self.liveness.forget(node.host)
        self._no_more_stacks_from(node.host)
        if missing_module(stderr) == "torchherd":
            node.error = {
                "message": f"torchherd is not installed for {node.plan.python} on {node.host}",
                "remedy": "install it there (`herd exec -- pip install torchherd`), "
                "or point python at an environment that has it",
            }
            self._set_state(node, NodeState.NOT_STARTED)
        elif link.cut_off:
            if node.state != NodeState.LOST:
                self._set_state(node, NodeState.STOPPED)
            self.teardown.sweep_later(node.plan)
        elif self.stopping and node.state == NodeState.STARTING:
            self._set_state(node, NodeState.STOPPED)
        else:
            detail = (
                unreachable.describe() if unreachable else f"agent exited with {node.exit_code}"
            )
            node.error = {
                "message": f"lost contact with {node.host} ({detail})",
                "remedy": unreachable.remedy if unreachable else "see the node's lines above",
                "last_stderr": list(node.stderr),
            }
            self._set_state(
                node, NodeState.STOPPED if self.stopping and not unreachable else NodeState.LOST
            )
            if unreachable is None:
                # The agent died but the node answers: end what it left behind there.
                self.teardown.sweep_later(node.plan)
        self._mark_done(node)
        self._on_node_failed(node)

    def _no_more_stacks_from(self, host: str) -> None:
        self._stacks_wanted.discard(host)
        if not self._stacks_wanted:
            self._stacks_arrived.set()

    def _on_node_failed(self, node: NodeRun) -> None:
        if not self._ending:
            self.trigger = node.host
            self.noticed = self.noticed or (
                "its agent's link ended" if node.state == NodeState.LOST else "a worker exited"
            )
            others = "; stopping the other nodes" if len(self.nodes) > 1 else ""
            self.output.note(f"herd: {node.host} failed{others}")
            self.end_with_evidence(except_host=node.host)

    def _ending_seen(self) -> None:
        if self.ending_at is None:
            self.ending_at = time.monotonic()

    def _mark_done(self, node: NodeRun) -> None:
        self._ending_seen()
        node.done = True
        self.teardown.ended(node.host)
        self._check_done()

    def _check_done(self) -> None:
        if all(n.done for n in self.nodes.values()):
            self._done.set()

    def _set_state(self, node: NodeRun, state: NodeState) -> None:
        node.state = state

    # -- watching -------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Every WATCH_EVERY s: this launcher's own stalls, silent nodes, stop deadlines,
        looks at a silent job and hangs."""
        clock = LauncherClock(WATCH_EVERY)
        while True:
            await asyncio.sleep(WATCH_EVERY)
            stalled = clock.tick()
            if stalled:
                self._stalled(stalled)
                continue
            for host in self.liveness.silent():
                link = self.links.get(host)
                if link is not None and link.has_unread():
                    self.liveness.heard(host)  # it spoke; this launcher is behind reading
                    continue
                if self._others_step(host):
                    continue
                self._silent(self.nodes[host])
            self.teardown.cut_overdue()
            if self._ending:
                continue
            if self.hang.wants_look():
                for node in self.nodes.values():
                    link = self.links.get(node.host)
                    if link is not None and node.state == NodeState.RUNNING and not node.done:
                        link.command("look")
            hang = self.hang.check()
            if hang is not None:
                self._hung(hang)

    def _stalled(self, seconds: float) -> None:
        """This launcher did not run for ``seconds``: nothing it failed to hear is evidence."""
        self.output.note(
            f"herd: this launcher did not run for {seconds:.0f} s (stopped, suspended or "
            "starved); the nodes are judged again from now"
        )
        self.liveness.excuse()
        self.hang.excuse(seconds)
        self.teardown.excuse(seconds)

    def _hung(self, hang: Any) -> None:
        self.hang_found = hang.describe()
        self.behind = hang.behind
        self.noticed = "the hang watch"
        if hang.finished:
            self._never_exited()
            return
        self.output.note(f"herd: the job is hung: {self.hang_found}")
        self.cause = Failure(
            host=hang.node or "",
            rank=None,
            exitcode=None,
            signal=None,
            message=f"hung: {self.hang_found}",
            remedy="see the stacks below for the rank that holds the others up; if the job is "
            "only quiet, have it print or call torchherd.progress.beat(step) (or wrap a long "
            "phase in torchherd.progress.phase(...)); --hang-timeout 0 turns the watch off",
        )
        self.end_with_evidence(gather=True)

    def _never_exited(self) -> None:
        """The others finished and a rank never exited: the job's work is done, so it ends as
        finished (no restart would redo anything useful), after the rank's stacks are taken."""
        self.never_exited = True
        self.noticed = "the others finished; a rank never exited"
        self.output.note(f"herd: the job {self.hang_found}")
        self.cause = Failure(
            host="",
            rank=None,
            exitcode=None,
            signal=None,
            message=self.hang_found or "finished, but a rank never exited",
            remedy="its stacks show what its interpreter waits for at exit: join or make daemon "
            "the threads it starts, end what its exit handlers wait on, and call "
            "torch.distributed.destroy_process_group()",
        )
        self.end_with_evidence(gather=True)

    def _others_step(self, host: str) -> bool:
        """A quiet link alone does not lose a node while the other nodes' ranks still step
        (its ranks take part in their collectives, or the steps would stop): it is given up
        to launcher_silence, said once."""
        now = self._clock()
        heard = self.liveness.last_heard(host)
        others = [t for h, t in self.stepped_at.items() if h != host]
        limit = max(self.cluster.launcher_silence, self.silence)
        if not steps_vouch_for(heard, others, now, self.silence, limit):
            return False
        quiet = now - heard
        if host not in self.quiet_said:
            self.quiet_said.add(host)
            self.output.note(
                f"herd: {host} has said nothing for {quiet:.0f} s, but the other nodes' ranks "
                "still step: not lost for a quiet link alone (given up to "
                f"{self.cluster.launcher_silence:.0f} s)"
            )
        return True

    def _silent(self, node: NodeRun) -> None:
        """A node that said nothing for too long: lost (its machine or its network)."""
        host = node.host
        self.liveness.forget(host)
        at = time.strftime("%H:%M:%S", time.localtime(self.liveness.last_heard_wall(host)))
        message = f"{host} stopped answering at {at} (network or machine down)"
        self.noticed = self.noticed or f"{host} went silent"
        node.error = {
            "message": message,
            "remedy": f"check that {host} is up and on the network (`herd doctor`); with "
            "--min-nodes the job goes on without it",
        }
        node.ended_at = time.monotonic()
        self._set_state(node, NodeState.LOST)
        link = self.links.get(host)
        if link is not None:
            link.cut()  # its link is dead or dying: do not wait for ssh to say so
        if self.cause is None and not self._ending:
            self.cause = Failure(host, None, None, None, message, remedy=node.error["remedy"])
        self.output.note(f"herd: {message}; stopping the other nodes")
        self._mark_done(node)
        self.end_with_evidence(except_host=host)

    async def _flush_output(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            self.output.flush()

    async def _ping_agents(self) -> None:
        while True:
            await asyncio.sleep(ping_every(self.cluster.launcher_silence))
            for node in self.nodes.values():
                link = self.links.get(node.host)
                if link is not None and not node.done:
                    link.command("ping")

    # -- the result -----------------------------------------------------------------------------

    def ended_state(self) -> AttemptState:
        """This attempt as it ended, frozen: what outcome.result_of reads."""
        return AttemptState(
            job_id=self.plan.job_id,
            number=self.number,
            log_dir=self.output.log_dir,
            states={host: node.state for host, node in self.nodes.items()},
            reusable=tuple(
                host
                for host, node in self.nodes.items()
                if node.state in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.STOPPED)
                and host not in self.survivors
                and (link := self.links.get(host)) is not None
                and link.alive
            ),
            unconfirmed=tuple(dict.fromkeys([*self.teardown.unconfirmed(), *self.survivors])),
            interrupted=self.interrupted,
            stopping=self.stopping,
            saving=self.saving,
            saved_after_request=self.saved_after_request,
            stopped_for_silence=self.stopped_for_silence,
            first_failure=self.first_failure(),
            hang_found=self.hang_found,
            never_exited=self.never_exited,
            behind=tuple(self.behind),
            evidence=self.evidence,
            steps=dict(self.hang.steps),
            max_step=self.hang.max_step,
            noticed=self.noticed or "",
            ranks_seen=frozenset(self.ranks_seen),
        )

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: herd's own finding (a lost node, a hang), else
        the workers' (see ``choose_first_failure``), with its cause in words when known."""
        failure = self.cause or choose_first_failure(list(self.nodes.values()), self.trigger)
        if failure is None:
            return None
        return in_words(failure, list(self.nodes.values()), self.plan.nodes, self.ranks_seen)
