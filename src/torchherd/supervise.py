"""The Supervisor runs a LaunchPlan: one node agent per node, events merged, failures spread.

Node states:  starting -> running -> succeeded | failed | stopped | lost
              starting -> not started            (the agent could not start the job)

The job is over when every agent has ended. What ends it early:
  - a node fails (its workers failed) or its agent's link drops: the others are stopped, since
    their workers would wait in a collective or a rendezvous that can never complete;
  - a node goes silent (no event, not even its 2-s "alive", for NodeLiveness.silence): it is
    lost ("stopped answering at ..."), its link is cut, the others are stopped;
  - a hang (HangWatch: no progress signal from any rank for longer than its limit);
  - ``interrupt()`` (Ctrl-C, SIGTERM, SIGHUP): every node is stopped at once.
Before herd stops a job that is not ending by itself (a failure, a lost node, a hang), it asks
every live agent for its workers' stacks and keeps them (recovery.evidence), so the summary can
name the rank that was behind. Stopping a node = telling its agent to stop and closing its
stdin; an agent that has not ended after the grace period plus 10 s is cut off (its link
killed), which its agent sees as a closed stdin and ends the job as well.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .agent.protocol import ATTEMPT_VAR, decode, missing_module
from .errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_NODE_NOT_READY, EXIT_OK, EXIT_SAVED
from .logs import FLUSH_EVERY, Failure, JobOutput, RunResult
from .plan import LaunchPlan, NodePlan
from .recovery import Evidence, HangWatch, NodeLiveness, explain
from .recovery.evidence import judge
from .recovery.liveness import SILENCE
from .spec import ClusterSpec
from .transport import Transport

# Signals that mean "stopped because something else failed", not a cause of failure.
_TEARDOWN_SIGNALS = {"SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"}
# Extra seconds an agent gets beyond the grace period before its link is cut.
STOP_MARGIN = 10.0
# Seconds between pings to each agent; an agent that hears nothing for SILENCE s stops its job.
HEARTBEAT_INTERVAL = 2.0
# Seconds herd waits for the workers' stacks before it stops a job (py-spy runs in parallel).
EVIDENCE_TIMEOUT = 30.0
# Seconds between looks for silent nodes and hangs.
WATCH_EVERY = 1.0
# Seconds beyond the grace period a sweep of a node whose agent was lost may take.
SWEEP_MARGIN = 15.0


@dataclass
class NodeRun:
    plan: NodePlan
    state: str = "starting"
    process: asyncio.subprocess.Process | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=30))
    exit_code: int | None = None
    ended_at: float | None = None


class Supervisor:
    def __init__(
        self,
        plan: LaunchPlan,
        cluster: ClusterSpec,
        transport: Transport,
        output: JobOutput,
        on_state: Callable[[str, str], None] | None = None,
        *,
        hang: HangWatch | None = None,
        silence: float = SILENCE,
        evidence_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        sessions: dict[str, asyncio.subprocess.Process] | None = None,
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.transport = transport
        self.output = output
        self.on_state = on_state
        self.nodes = {p.host: NodeRun(p) for p in plan.nodes}
        self.hang = hang if hang is not None else HangWatch(clock=clock)
        self.liveness = NodeLiveness(self.nodes, silence=silence, clock=clock)
        self.silence = silence
        self.evidence = Evidence(evidence_dir or output.log_dir / "stacks")
        self.cause: Failure | None = None
        """Set when herd itself found the cause (a lost node, a hang); wins over workers'."""
        self.hang_found: str | None = None
        self.noticed: str | None = None
        """How herd noticed what ended the attempt early, in words (for the job's story)."""
        self._sessions = dict(sessions or {})
        """Agent sessions already open (prewarmed while the launcher planned), by host."""
        self._stacks_wanted: set[str] = set()
        self._stacks_arrived = asyncio.Event()
        self._ending = False
        self._sweeps: list[asyncio.Task[None]] = []
        self.stopping = False
        self.interrupted = False
        self.saving = False
        """Workers were asked to save a snapshot and stop (a time limit is near)."""
        self.trigger: str | None = None
        """The node whose failure made the supervisor stop the others."""
        self._stop_deadline: float | None = None

    async def run(self) -> RunResult:
        started = time.monotonic()
        tasks = [asyncio.create_task(self._run_node(node)) for node in self.nodes.values()]
        helpers = [
            asyncio.create_task(self._cut_off_after_deadline()),
            asyncio.create_task(self._ping_agents()),
            asyncio.create_task(self._flush_output()),
            asyncio.create_task(self._watch()),
        ]
        try:
            await asyncio.gather(*tasks)
            if self._sweeps:
                await asyncio.wait(self._sweeps, timeout=self.plan.grace + SWEEP_MARGIN)
        finally:
            for task in [*helpers, *tasks, *self._sweeps]:
                task.cancel()
        return self._result(time.monotonic() - started)

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop every node; a second one cuts every link at once."""
        if self.interrupted:
            self._cut_off_all()
            return
        self.interrupted = True
        self.output.note("herd: stopping the job on every node (Ctrl-C again to cut off now)")
        self._ending = True
        self.stop_all()

    def request_save(self, within: float) -> None:
        """Ask every worker to save a snapshot and stop (torchherd.train does at its next log
        step); whatever still runs after ``within`` seconds is stopped."""
        if self.saving or self.stopping:
            return
        self.saving = True
        self.output.note(
            f"herd: asking every worker to save a snapshot and stop (stopping in {within:g} s "
            "at the latest)"
        )
        for node in self.nodes.values():
            self._send(node, b'{"cmd":"save"}\n')
        asyncio.get_running_loop().call_later(within, self.stop_all)

    def end_with_evidence(self, except_host: str | None = None) -> None:
        """Stop every node, after gathering the workers' stacks from the live ones."""
        if self._ending or self.stopping:
            return
        self._ending = True
        asyncio.get_running_loop().create_task(self._gather_then_stop(except_host))

    async def _gather_then_stop(self, except_host: str | None) -> None:
        try:
            await self.gather_stacks()
        finally:
            self.stop_all(except_host)

    async def gather_stacks(self, timeout: float = EVIDENCE_TIMEOUT) -> None:
        """Ask every running agent for its workers' stacks; wait for them (at most timeout)."""
        live = [n for n in self.nodes.values() if n.state == "running"]
        self._stacks_wanted = {n.plan.host for n in live}
        if not live:
            return
        self.output.note(
            f"herd: taking the workers' stacks on {len(live)} node(s) before stopping the job"
        )
        self._stacks_arrived.clear()
        for node in live:
            self._send(node, b'{"cmd":"stacks"}\n')
        try:
            await asyncio.wait_for(self._stacks_arrived.wait(), timeout)
        except TimeoutError:
            missing = ", ".join(sorted(self._stacks_wanted))
            self.evidence.problems.append(f"no stacks from {missing} within {timeout:g} s")

    def stop_all(self, except_host: str | None = None) -> None:
        self._ending = True
        if not self.stopping:
            self.stopping = True
            self._stop_deadline = time.monotonic() + self.plan.grace + STOP_MARGIN
        for host, node in self.nodes.items():
            if host != except_host:
                self._tell_stop(node)

    # -- one node ---------------------------------------------------------------------------

    async def _run_node(self, node: NodeRun) -> None:
        spec = self.cluster.node(node.plan.host)
        command = [node.plan.python, "-m", "torchherd.agent", "run"]
        try:
            process = self._sessions.pop(node.plan.host, None)
            if process is None or process.returncode is not None:
                process = await self.transport.start(spec, command)
        except OSError as exc:
            node.error = {"message": f"cannot start ssh: {exc}", "remedy": ""}
            self._set_state(node, "not started")
            return
        node.process = process
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(self._request(node.plan)).encode() + b"\n")
        if self.stopping:
            self._tell_stop(node)
        try:
            await process.stdin.drain()
        except (ConnectionError, OSError):
            pass
        stderr_task = asyncio.create_task(self._read_stderr(node))
        async for raw in _lines(process.stdout):
            event = decode(raw)
            if event is None:
                self.output.line(node.plan.host, None, raw.decode(errors="replace").rstrip())
                continue
            self._handle(node, event)
        node.exit_code = await process.wait()
        await stderr_task
        node.ended_at = time.monotonic()
        if node.state in ("starting", "running"):
            self._lost(node)

    def agent_request(self, plan: NodePlan) -> dict[str, Any]:
        """The request an agent reads first on stdin; `herd launch --detach` sends it too."""
        return self._request(plan)

    def _request(self, plan: NodePlan) -> dict[str, Any]:
        return {
            "job_id": self.plan.job_id,
            "node": plan.name,
            "workdir": self.plan.workdir,
            "argv": list(plan.argv),
            "env": dict(plan.env),
            "secret_env": dict(self.plan.secret_env),
            "grace": self.plan.grace,
            "heartbeat": HEARTBEAT_INTERVAL,
            "silence": self.silence,
        }

    async def _read_stderr(self, node: NodeRun) -> None:
        assert node.process is not None and node.process.stderr is not None
        async for raw in _lines(node.process.stderr):
            text = raw.decode(errors="replace").rstrip()
            node.stderr.append(text)
            self.output.line(node.plan.host, None, text)

    def _handle(self, node: NodeRun, event: dict[str, Any]) -> None:
        kind = event.get("e")
        host = node.plan.host
        if node.state != "lost":
            self.liveness.heard(host)
        if kind == "line":
            rank = event.get("r")
            self.output.line(host, rank, event.get("t", ""))
            self.hang.signal(rank)
        elif kind == "beat":
            self.hang.signal(event.get("r"), event.get("step"))
        elif kind == "alive":
            pass
        elif kind == "stacks":
            self.evidence.add(host, event)
            self._no_more_stacks_from(host)
        elif kind == "started":
            self._set_state(node, "running")
            self.liveness.watch(host)
        elif kind == "error":
            node.error = event
            self._set_state(node, "not started")
            self._on_node_failed(node)
        elif kind == "exit":
            self.liveness.forget(host)
            self._no_more_stacks_from(host)  # an agent that ended sends none
            node.failures = list(event.get("failures", []))
            if event.get("error"):
                node.error = event["error"] | {"last_stderr": event.get("last_stderr", [])}
            if event.get("code") == 0:
                self._set_state(node, "succeeded")
            elif event.get("stopped"):
                self._set_state(node, "stopped")
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
                self._set_state(node, "failed")
                self._on_node_failed(node)

    def _lost(self, node: NodeRun) -> None:
        stderr = "\n".join(node.stderr)
        spec = self.cluster.node(node.plan.host)
        unreachable = self.transport.classify_failure(spec, node.exit_code or 0, stderr)
        if missing_module(stderr) == "torchherd":
            node.error = {
                "message": f"torchherd is not installed for {node.plan.python} on {node.plan.host}",
                "remedy": "install it there (`herd exec -- pip install torchherd`), "
                "or point python at an environment that has it",
            }
            self._set_state(node, "not started")
        elif self.stopping and node.state == "starting":
            self._set_state(node, "stopped")
            return
        else:
            detail = (
                unreachable.describe() if unreachable else f"agent exited with {node.exit_code}"
            )
            node.error = {
                "message": f"lost contact with {node.plan.host} ({detail})",
                "remedy": unreachable.remedy if unreachable else "see the node's lines above",
                "last_stderr": list(node.stderr),
            }
            self._set_state(node, "stopped" if self.stopping and not unreachable else "lost")
            if node.state == "lost" and unreachable is None:
                # The agent died but the node answers: end what it left behind there.
                self._sweeps.append(asyncio.create_task(self._sweep(node)))
        self._on_node_failed(node)

    async def _sweep(self, node: NodeRun) -> None:
        """Run the `stop` verb on a node whose agent is gone (its job's processes, by tag)."""
        from .ops.remote import call_agent

        spec = self.cluster.node(node.plan.host)
        request = {
            "job_id": self.plan.job_id,
            "node": node.plan.name,
            "grace": self.plan.grace,
            "attempt": node.plan.env.get(ATTEMPT_VAR),
        }
        if node.plan.env.get("HERD_HOME"):
            request["herd_home"] = node.plan.env["HERD_HOME"]
        answer = await call_agent(
            self.transport, spec, "stop", request, timeout=self.plan.grace + SWEEP_MARGIN
        )
        if answer.ok and answer.data and answer.data.get("processes"):
            self.output.note(
                f"herd: ended {answer.data['processes']} process(es) the lost agent left on "
                f"{node.plan.host}"
            )

    def _no_more_stacks_from(self, host: str) -> None:
        self._stacks_wanted.discard(host)
        if not self._stacks_wanted:
            self._stacks_arrived.set()

    def _on_node_failed(self, node: NodeRun) -> None:
        if not self._ending:
            self.trigger = node.plan.host
            self.noticed = self.noticed or (
                "its agent's link ended" if node.state == "lost" else "a worker exited"
            )
            self.output.note(f"herd: {node.plan.host} failed; stopping the other nodes")
            self.end_with_evidence(except_host=node.plan.host)

    # -- detection ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Every WATCH_EVERY s: nodes gone silent, and hangs."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            for host in self.liveness.silent():
                self._silent(self.nodes[host])
            if self._ending:
                continue
            hang = self.hang.check()
            if hang is not None:
                self.hang_found = hang.describe()
                self.noticed = "the hang watch"
                self.output.note(f"herd: the job is hung: {self.hang_found}")
                self.cause = Failure(
                    host="",
                    rank=None,
                    exitcode=None,
                    signal=None,
                    message=f"hung: {self.hang_found}",
                    remedy="see the stacks below for the rank that holds the others up; if the "
                    "job is just slow to report, print or call torchherd.progress.beat(step) "
                    "more often, or set --hang-timeout (0 turns the watch off)",
                )
                self.end_with_evidence()

    def _silent(self, node: NodeRun) -> None:
        """A node that said nothing for too long: lost (its machine or its network)."""
        host = node.plan.host
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
        self._set_state(node, "lost")
        if node.process is not None and node.process.returncode is None:
            try:
                node.process.kill()  # its link is dead or dying: do not wait for ssh to say so
            except ProcessLookupError:
                pass
        if self.cause is None and not self._ending:
            self.cause = Failure(host, None, None, None, message, remedy=node.error["remedy"])
        self.output.note(f"herd: {message}; stopping the other nodes")
        self.end_with_evidence(except_host=host)

    def _set_state(self, node: NodeRun, state: str) -> None:
        node.state = state
        if self.on_state is not None:
            self.on_state(node.plan.host, state)

    def _tell_stop(self, node: NodeRun) -> None:
        process = node.process
        if process is None or process.stdin is None or process.stdin.is_closing():
            return
        try:
            process.stdin.write(b'{"cmd":"stop"}\n')
            process.stdin.close()
        except (ConnectionError, OSError, RuntimeError):
            pass

    async def _flush_output(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            self.output.flush()

    async def _ping_agents(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            for node in self.nodes.values():
                self._send(node, b'{"cmd":"ping"}\n')

    @staticmethod
    def _send(node: NodeRun, command: bytes) -> None:
        stdin = node.process.stdin if node.process is not None else None
        if stdin is not None and not stdin.is_closing():
            try:
                stdin.write(command)
            except (ConnectionError, OSError, RuntimeError):
                pass

    async def _cut_off_after_deadline(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                self._cut_off_all()
                return

    def _cut_off_all(self) -> None:
        for node in self.nodes.values():
            if node.process is not None and node.process.returncode is None:
                try:
                    node.process.kill()
                except ProcessLookupError:
                    pass

    # -- the result ---------------------------------------------------------------------------

    def _result(self, duration: float) -> RunResult:
        behind = judge(self.evidence.stacks, self.hang.steps)
        stacks_dir = self.evidence.save(behind)
        status = {host: node.state for host, node in self.nodes.items()}
        # Every agent ended its job on request, and not this launcher's: `herd stop` did it.
        stopped_elsewhere = not self.stopping and all(s == "stopped" for s in status.values())
        if self.saving and all(s in ("succeeded", "stopped") for s in status.values()):
            code = EXIT_SAVED
        elif all(state == "succeeded" for state in status.values()):
            code = EXIT_OK
        elif self.interrupted or stopped_elsewhere:
            code = EXIT_INTERRUPTED
        elif any(state == "not started" for state in status.values()):
            code = EXIT_NODE_NOT_READY
        else:
            code = EXIT_JOB_FAILED
        failure = None
        if code not in (EXIT_OK, EXIT_SAVED) and not stopped_elsewhere:
            failure = self.first_failure()
            if failure is not None and behind and failure.rank is None and self.hang_found:
                first = behind[0]
                failure = Failure(
                    first.host, first.rank, None, None, failure.message, remedy=failure.remedy
                )
        return RunResult(
            job_id=self.plan.job_id,
            exit_code=code,
            node_status=status,
            first_failure=failure,
            duration=duration,
            log_dir=self.output.log_dir,
            behind=tuple(b.line() for b in behind),
            stacks_dir=stacks_dir,
            evidence_problems=tuple(self.evidence.problems),
            hang=self.hang_found,
            lost=tuple(h for h, s in status.items() if s == "lost"),
            max_step=self.hang.max_step,
        )

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: herd's own finding (a lost node, a hang), else
        the workers' (see ``choose_first_failure``), with its cause in words when known."""
        failure = self.cause or choose_first_failure(list(self.nodes.values()), self.trigger)
        if failure is None:
            return None
        text = "\n".join((failure.message, *failure.last_stderr))
        found = explain(text)
        if found is None or failure.cause:
            return failure
        cause = found.cause
        if found.kind == "rendezvous-timeout":
            absent = self._never_joined()
            if absent:
                cause += f"; never joined: {', '.join(absent)}"
        elif found.kind == "peer-connection":
            peer = self._peer_named_in(text)
            if peer is not None:
                cause += f"; the peer is {peer}"
        return Failure(
            failure.host,
            failure.rank,
            failure.exitcode,
            failure.signal,
            failure.message,
            failure.last_stderr,
            remedy=failure.remedy or found.fix,
            cause=cause,
        )

    def _never_joined(self) -> list[str]:
        """Nodes whose workers never started (no rank spoke there) and that did not time out
        waiting in the rendezvous themselves: the ones the others waited for."""
        spoke = {host for host, _ in self.output.ranks_seen}
        waited = {
            host
            for host, node in self.nodes.items()
            if node.error
            and "Rendezvous" in f"{node.error.get('error', '')} {node.error.get('message', '')}"
        }
        return [host for host in self.nodes if host not in spoke and host not in waited]

    def _peer_named_in(self, text: str) -> str | None:
        """The node whose address a connection error names."""
        for node in self.plan.nodes:
            if node.local_addr and re.search(rf"\b{re.escape(node.local_addr)}\b", text):
                return node.host
        return None


# What a worker says when a peer died first: its failure is a consequence, not the cause.
_PEER_LOSS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh failed",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "DistNetworkError",
    "DistStoreError",
)

# Classes of failure, most likely a cause first.
_OWN, _NODE, _PEER, _TEARDOWN, _STOPPED_NODE = range(5)


def choose_first_failure(nodes: list[NodeRun], trigger: str | None) -> Failure | None:
    """The failure that caused the others.

    Timestamps alone cannot tell (torchrun records whole seconds, and peers fail within the
    same second), so failures are ranked by what they are: a worker's own exit before a node
    that was lost or could not start, before a worker that lost a peer, before workers killed
    by the teardown. Within a class the node that failed first (``trigger``: the one that made
    herd stop the others) wins, then the earlier timestamp.
    """
    candidates: list[tuple[int, int, float, Failure]] = []
    for node in nodes:
        host = node.plan.host
        first = 0 if host == trigger else 1
        for item in node.failures:
            stderr = tuple(item.get("last_stderr", ()))
            said = "\n".join((*stderr, str(item.get("message", ""))))
            if item.get("signal") in _TEARDOWN_SIGNALS:
                kind = _TEARDOWN
            elif any(pattern in said for pattern in _PEER_LOSS):
                kind = _PEER
            else:
                kind = _OWN
            failure = Failure(
                host=host,
                rank=item.get("rank"),
                exitcode=item.get("exitcode"),
                signal=item.get("signal"),
                message=_first_line(item.get("message", "")),
                last_stderr=stderr,
            )
            candidates.append((kind, first, float(item.get("timestamp") or 0), failure))
        if node.error is not None and not node.failures:
            failure = Failure(
                host=host,
                rank=None,
                exitcode=None,
                signal=None,
                message=str(node.error.get("message", "")),
                last_stderr=tuple(node.error.get("last_stderr", ()))[-10:],
                remedy=str(node.error.get("remedy", "")),
            )
            kind = _STOPPED_NODE if node.state == "stopped" else _NODE
            candidates.append((kind, first, node.ended_at or float("inf"), failure))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[:3])[3]


async def _lines(stream: asyncio.StreamReader) -> Any:
    """Lines of a stream; a line longer than the reader's limit comes in pieces, never as an
    error that would end the supervision (agents split long lines, other output may not)."""
    while True:
        try:
            raw = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            raw = await stream.readexactly(exc.consumed)
        yield raw


def _first_line(text: str) -> str:
    text = text.strip()
    if "To enable traceback" in text:
        return ""
    return text.splitlines()[0] if text else ""
