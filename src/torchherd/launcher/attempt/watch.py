"""The attempt's watch: every WATCH_EVERY s it reads what the attempt knows and decides.

What it looks for, in this order:
  - this launcher's own stall (it did not run: stopped, suspended, starved): nothing it failed
    to hear is evidence, so the nodes are judged again from now;
  - a silent node (not even its 2-s "alive" for [cluster] link_silence, 10 s, while this
    launcher was there to hear): lost ("stopped answering at ..."), its link is cut, the others
    stopped; unless the other nodes' ranks still step after its last word (its ranks take
    part in their collectives): then a quiet link alone loses it only past launcher_silence;
  - stop deadlines passed (teardown.Teardown cuts those nodes off);
  - a hang (recovery.hang: silence makes herd look at the ranks; the evidence decides), or
    a job whose work finished while a rank never exited.
The judges are the recovery package's (liveness, hang); this module only acts on their
verdicts, through the attempt's actions. The slow-rank watch runs beside it (slow_ranks.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ...logs import JobOutput
from ...recovery import HangWatch, NodeLiveness
from ...recovery.failures import NodeRun, NodeState
from ...recovery.hang import Hang
from ...recovery.liveness import LauncherClock, steps_vouch_for
from ...results import Failure
from ...spec import ClusterSpec
from ..links import AgentLink
from ..teardown import Teardown
from .actions import AttemptActions
from .state import LiveState

# Seconds between looks for silent nodes, stalls, deadlines and hangs.
WATCH_EVERY = 1.0
# At most one line a minute about this launcher's own stalls: on a starved machine they come
# several a minute, and each line would say the same thing.
STALL_LINE_EVERY = 60.0


class StallLines:
    """What to say about this launcher's stalls: the first at once, later ones at most one
    line every STALL_LINE_EVERY s, which names the longest and counts the rest."""

    def __init__(self) -> None:
        self.said_at: float | None = None
        self.unsaid: list[float] = []

    def stalled(self, seconds: float, now: float) -> str | None:
        self.unsaid.append(seconds)
        return self.due(now)

    def due(self, now: float) -> str | None:
        """The line owed now, if one is (stalls not yet told and a minute since the last)."""
        if not self.unsaid or (self.said_at is not None and now - self.said_at < STALL_LINE_EVERY):
            return None
        stalls, self.unsaid, self.said_at = self.unsaid, [], now
        line = (
            f"herd: this launcher did not run for {max(stalls):.0f} s (stopped, suspended or "
            "starved); the nodes are judged again from now"
        )
        if len(stalls) > 1:
            line += f" ({len(stalls)} stalls, {sum(stalls):.0f} s in all, since the last line)"
        return line


class AttemptWatch:
    """Liveness, stalls, stop deadlines and hangs of one attempt, judged every WATCH_EVERY s."""

    def __init__(
        self,
        state: LiveState,
        actions: AttemptActions,
        *,
        cluster: ClusterSpec,
        links: dict[str, AgentLink],
        teardown: Teardown,
        output: JobOutput,
        liveness: NodeLiveness,
        hang: HangWatch,
        silence: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.actions = actions
        self.cluster = cluster
        self.links = links
        self.teardown = teardown
        self.output = output
        self.liveness = liveness
        self.hang = hang
        self.silence = silence
        """Seconds without a word after which a node is lost ([cluster] link_silence)."""
        self.clock = clock
        self.stall_lines = StallLines()

    async def run(self) -> None:
        """Every WATCH_EVERY s: this launcher's own stalls, silent nodes, stop deadlines,
        looks at a silent job and hangs (cancelled with the attempt)."""
        launcher = LauncherClock(WATCH_EVERY)
        while True:
            await asyncio.sleep(WATCH_EVERY)
            stalled = launcher.tick()
            if stalled:
                self.stalled(stalled)
                continue
            owed = self.stall_lines.due(self.clock())
            if owed is not None:
                self.output.note(owed)
            for host in self.liveness.silent():
                link = self.links.get(host)
                if link is not None and link.has_unread():
                    self.liveness.heard(host)  # it spoke; this launcher is behind reading
                    continue
                if self.others_step(host):
                    continue
                self.silent(self.state.nodes[host])
            self.teardown.cut_overdue()
            if self.state.ending:
                continue
            if self.hang.wants_look():
                for host in self.state.running():
                    link = self.links.get(host)
                    if link is not None:
                        link.command("look")
            hang = self.hang.check()
            if hang is not None:
                self.hung(hang)

    def stalled(self, seconds: float) -> None:
        """This launcher did not run for ``seconds``: nothing it failed to hear is evidence."""
        line = self.stall_lines.stalled(seconds, self.clock())
        if line is not None:
            self.output.note(line)
        self.liveness.excuse()
        self.hang.excuse(seconds)
        self.teardown.excuse(seconds)

    def others_step(self, host: str) -> bool:
        """A quiet link alone does not lose a node while the other nodes' ranks still step
        (its ranks take part in their collectives, or the steps would stop): it is given up
        to launcher_silence, said once."""
        state = self.state
        now = self.clock()
        heard = self.liveness.last_heard(host)
        others = [t for h, t in state.stepped_at.items() if h != host]
        limit = max(self.cluster.launcher_silence, self.silence)
        if not steps_vouch_for(heard, others, now, self.silence, limit):
            return False
        quiet = now - heard
        if host not in state.quiet_said:
            state.quiet_said.add(host)
            self.output.note(
                f"herd: {host} has said nothing for {quiet:.0f} s, but the other nodes' ranks "
                "still step: not lost for a quiet link alone (given up to "
                f"{self.cluster.launcher_silence:.0f} s)"
            )
        return True

    def silent(self, node: NodeRun) -> None:
        """A node that said nothing for too long: lost (its machine or its network)."""
        state = self.state
        host = node.host
        self.liveness.forget(host)
        at = time.strftime("%H:%M:%S", time.localtime(self.liveness.last_heard_wall(host)))
        message = f"{host} stopped answering at {at} (network or machine down)"
        state.noticed = state.noticed or f"{host} went silent"
        node.error = {
            "message": message,
            "remedy": f"check that {host} is up and on the network (`herd doctor`); with "
            "--min-nodes the job goes on without it",
        }
        node.ended_at = time.monotonic()
        node.state = NodeState.LOST
        link = self.links.get(host)
        if link is not None:
            link.cut()  # its link is dead or dying: do not wait for ssh to say so
        if state.cause is None and not state.ending:
            state.cause = Failure(host, None, None, None, message, remedy=node.error["remedy"])
        self.output.note(f"herd: {message}; stopping the other nodes")
        self.actions.done(node)
        self.actions.end_with_evidence(except_host=host)

    def hung(self, hang: Hang) -> None:
        state = self.state
        state.hang_found = hang.describe()
        state.behind = hang.behind
        state.noticed = "the hang watch"
        if hang.finished:
            self.never_exited()
            return
        self.output.note(f"herd: the job is hung: {state.hang_found}")
        state.cause = Failure(
            host=hang.node or "",
            rank=None,
            exitcode=None,
            signal=None,
            message=f"hung: {state.hang_found}",
            remedy="see the stacks below for the rank that holds the others up; if the job is "
            "only quiet, have it print or call torchherd.progress.beat(step) (or wrap a long "
            "phase in torchherd.progress.phase(...)); --hang-timeout 0 turns the watch off",
        )
        self.actions.end_with_evidence(gather=True)

    def never_exited(self) -> None:
        """The others finished and a rank never exited: the job's work is done, so it ends as
        finished (no restart would redo anything useful), after the rank's stacks are taken."""
        state = self.state
        state.never_exited = True
        state.noticed = "the others finished; a rank never exited"
        self.output.note(f"herd: the job {state.hang_found}")
        state.cause = Failure(
            host="",
            rank=None,
            exitcode=None,
            signal=None,
            message=state.hang_found or "finished, but a rank never exited",
            remedy="its stacks show what its interpreter waits for at exit: join or make daemon "
            "the threads it starts, end what its exit handlers wait on, and call "
            "torch.distributed.destroy_process_group()",
        )
        self.actions.end_with_evidence(gather=True)
