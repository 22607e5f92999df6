"""One attempt of a job on this node: torchrun's wrapper, its output, its progress, its end.

An attempt is one run of the job's command (the torchrun wrapper) with its own rendezvous. Its
processes all carry the job id, the node and the attempt number (HERD_ATTEMPT), so everything
it sweeps at its end is its own: never an earlier or a later attempt's, never another job's.

    start      the prewarmed wrapper when it fits (torch already imported), else a new one
    run        output lines -> events; progress files -> beats/phase/saved events
    end        the command exits by itself, or is stopped (SIGTERM, grace, the stacks of what
               is still running, SIGKILL), then every tagged process of the attempt is swept
    report     one exit event: how the command ended, each failed rank, and why it stopped

Per-attempt files: ``<node_dir>/attempt-N/failure.json`` (torchrun's failure record) and the
progress directory on node-local storage (``progress_root()``), removed once the attempt ends.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from .. import progress
from ..files import private_dir, write_private
from . import processes, stacks, worker_exits
from .control import write_agent_record
from .elastic import FAILURE_FILE_VAR, NODE_DIR_VAR, PREWARM_FLAG
from .protocol import ATTEMPT_VAR, JOB_ID_VAR, LINE_PREFIX_TEMPLATE, NODE_VAR, RankLines

Emit = Callable[[dict[str, Any]], None]

ELASTIC_MODULE = "torchherd.agent.elastic"
# Lines of stderr kept per rank for the failure summary.
STDERR_TAIL = 20
# Longest text of one line event; longer worker lines travel in pieces (the launcher's reader
# and its memory stay bounded, whatever a worker prints).
MAX_LINE = 64 * 1024
# Seconds between looks for exited orphans to reap.
REAP_EVERY = 1.0
# Seconds between looks at the workers' progress files (and reports of what changed), unless
# the request says (``report_every``: less often on large jobs).
PROGRESS_POLL = 1.0
# Global rank -> local rank of the attempt's workers on this node, in the attempt's directory.
RANKS_FILE = "ranks.json"
# Seconds the final sweep gives what is left of the attempt after SIGTERM.
SWEEP_GRACE = 5.0
# What ending an attempt may take beyond its grace period: the stacks of what still runs
# (stacks.DUMP_TIMEOUT), SIGKILL and the sweep. The launcher waits this long before it calls
# a stopping node's agent stuck.
TEARDOWN_BUDGET = stacks.DUMP_TIMEOUT + 2 * SWEEP_GRACE


def herd_home(env: dict[str, str]) -> str:
    return os.path.expanduser(env.get("HERD_HOME") or os.environ.get("HERD_HOME") or "~/.herd")


_progress_root: str | None = None


def progress_root() -> str:
    """Node-local storage for progress files: ``herd-<uid>`` in the user's runtime directory,
    else in /dev/shm, else in the temporary directory; never the home (an NFS home that stalls
    would freeze training inside ``beat()``). Such a name in a shared directory can be taken
    first by anyone: it is used only when it is this user's own directory (no link, 0700);
    otherwise the next place, and at last a fresh private directory of its own."""
    global _progress_root
    if _progress_root is not None and _is_own_private_dir(_progress_root):
        return _progress_root
    for candidate in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm", tempfile.gettempdir()):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            path = os.path.join(candidate, f"herd-{os.getuid()}")
            if _is_own_private_dir(path):
                _progress_root = path
                return path
    _progress_root = tempfile.mkdtemp(prefix=f"herd-{os.getuid()}-")
    return _progress_root


def _is_own_private_dir(path: str) -> bool:
    """``path`` is (or is now made) a directory of this user's alone: not a link, owned by
    this user, mode 0700 (set if it was looser)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        found = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        return False
    if found.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError:
            return False
    return True


def attempt_of(request: dict[str, Any]) -> str:
    return str(dict(request.get("env", {})).get(ATTEMPT_VAR, "0"))


def start_wrapper(
    argv: list[str], env: dict[str, str], **popen: Any
) -> tuple[subprocess.Popen[bytes], worker_exits.Notices]:
    """torchrun's wrapper in a session of its own, its output piped, with the pipe its word of
    a worker's bad end comes back on (agent/worker_exits.py)."""
    notices = worker_exits.Notices()
    try:
        process = subprocess.Popen(
            argv,
            env=env | notices.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=notices.pass_fds,
            **popen,
        )
    except BaseException:
        notices.discard()
        raise
    notices.close_theirs()
    return process, notices


class Prewarmed:
    """torchrun's wrapper, started before its attempt's request arrives so that its torch
    import overlaps the launcher's work (a first launch's probe and plan, or the teardown of
    the attempt before)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.python = str(spec["python"])
        self.workdir = spec.get("workdir")
        self.attempt = str(spec.get("attempt", 0))
        cwd = os.path.expanduser(self.workdir) if self.workdir else None
        env = dict(os.environ)
        env.update(
            {
                JOB_ID_VAR: str(spec["job_id"]),
                NODE_VAR: str(spec["node"]),
                ATTEMPT_VAR: self.attempt,
            }
        )
        env.update({k: str(v) for k, v in dict(spec.get("env") or {}).items()})
        env.setdefault("PYTHONUNBUFFERED", "1")
        processes.become_subreaper()
        self.process, self.notices = start_wrapper(
            [os.path.expanduser(self.python), "-m", ELASTIC_MODULE, PREWARM_FLAG],
            env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdin=subprocess.PIPE,
        )

    def fits(self, request: dict[str, Any]) -> bool:
        argv = list(request.get("argv", []))
        return (
            argv[:3] == [self.python, "-m", ELASTIC_MODULE]
            and request.get("workdir") == self.workdir
            and attempt_of(request) == self.attempt
            and self.process.poll() is None
        )

    def hand_over(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Give the waiting wrapper its job; it runs torchrun from here on."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"argv": argv[3:], "env": env}).encode() + b"\n")
            self.process.stdin.close()
        except OSError:
            pass  # it died (torch could not be imported): its own output says why
        return self.process

    def discard(self) -> None:
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.notices.discard()


class NodeAttempt:
    """One attempt of the job on this node: its process, its output pumps and its end."""

    def __init__(
        self, request: dict[str, Any], emit: Emit, prewarmed: Prewarmed | None = None
    ) -> None:
        self.request = request
        self.emit = emit
        self.prewarmed = prewarmed
        self.job_id: str = request["job_id"]
        self.node: str = request["node"]
        self.attempt = attempt_of(request)
        self.grace: float = float(request.get("grace", 10))
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_requested = threading.Event()
        self.why_stopped = ""
        """Why the attempt was stopped: "asked" (the launcher), "signal" (herd stop),
        "launcher-silent" (no ping for too long), "launcher-gone" (its link closed)."""
        self._stacks_before_stop = False
        self._worker_exit_told = False  # the launcher heard of a bad worker end (once)
        self.notices: worker_exits.Notices | None = None  # the wrapper's notice pipe
        self._kill_now = threading.Event()
        self.stderr_tails: dict[int | None, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=STDERR_TAIL)
        )
        self.local_ranks: dict[int, int] = {}
        """Global rank -> local rank of the workers seen here."""
        # stdout's and stderr's pumps both learn ranks: one writer of the rank map at a time.
        self._rank_map_lock = threading.Lock()
        self.spoke: set[int] = set()
        """Ranks whose lines were kept here (not sent) since the last report."""
        self.spoke_told: set[int] = set()
        """Ranks the launcher was told spoke (in a "spoke" event) at least once."""
        self._progress_sent: dict[tuple[int, str], object] = {}
        """What was reported of each rank's progress: the periodic reports and the last one
        before the exit event share it, so a beat is never sent twice."""
        self._progress_lock = threading.Lock()
        env = dict(request.get("env", {}))
        self.node_dir = os.path.join(herd_home(env), "nodes", self.job_id, self.node)
        self.attempt_dir = os.path.join(self.node_dir, f"attempt-{self.attempt}")
        self.failure_file = os.path.join(self.attempt_dir, "failure.json")
        self.progress_dir = os.path.join(
            progress_root(), self.job_id, self.node, f"attempt-{self.attempt}"
        )

    # -- the attempt's life -------------------------------------------------------------------

    def run(self) -> int:
        """Run the attempt to its end; its exit event is the last thing it emits."""
        workdir = self.request.get("workdir")
        if workdir:
            path = os.path.expanduser(workdir)
            if not os.path.isdir(path):
                self.emit(
                    {
                        "e": "error",
                        "a": self.attempt,
                        "message": f"working directory {path} does not exist on {self.node}",
                        "remedy": "copy the project there with `herd sync`, or set [cluster] "
                        "workdir to a directory that exists on every node",
                    }
                )
                return 3
            os.chdir(path)
        home = herd_home(dict(self.request.get("env", {})))
        private_dir(self.attempt_dir, home=home)
        private_dir(self.progress_dir, home=progress_root())
        # Where `herd stop` (from any terminal) finds this agent to end the job cleanly.
        write_agent_record(
            self.node_dir,
            self.job_id,
            self.node,
            bool(self.request.get("detach")),
            attempt=self.attempt,
        )
        processes.become_subreaper()
        try:
            self.process = self._start()
        except OSError as exc:
            self.emit(
                {
                    "e": "error",
                    "a": self.attempt,
                    "message": f"cannot start {self.request['argv'][0]} on {self.node}: {exc}",
                    "remedy": "check [cluster] python (or the node's python) in herd.toml",
                }
            )
            return 3
        self.emit(
            {
                "e": "started",
                "a": self.attempt,
                "at": time.time(),  # the node's clock: its start marks are read against it
                "host": self.node,
                "pid": self.process.pid,
                "node_dir": self.node_dir,
            }
        )
        pumps = [
            threading.Thread(target=self._pump, args=(self.process.stdout, "o"), daemon=True),
            threading.Thread(target=self._pump, args=(self.process.stderr, "e"), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        if self.notices is not None:
            notices = self.notices.read
            threading.Thread(target=notices, args=(self._worker_ended_badly,), daemon=True).start()
        threading.Thread(target=self._stop_when_asked, daemon=True).start()
        threading.Thread(target=self._report_progress, daemon=True).start()
        threading.Thread(target=self._reap_orphans, daemon=True).start()
        code = self.process.wait()
        for pump in pumps:
            pump.join(timeout=5)
        survivors = processes.end_job(self.job_id, self.node, SWEEP_GRACE, self.attempt)
        # The last beats, phases and saves before the exit event (only what is new).
        self._send_progress()
        # Before the exit event: once the launcher hears it, the next attempt may begin here.
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        node_folder = os.path.dirname(self.progress_dir)
        for folder in (node_folder, os.path.dirname(node_folder)):  # the node's, the job's
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only once empty: the same job may run here in another agent
        self.emit(self._exit_event(code, survivors))
        return 130 if self.stop_requested.is_set() else (0 if code == 0 else 1)

    def _start(self) -> subprocess.Popen[bytes]:
        """torchrun's wrapper for this attempt: the prewarmed one when it fits, else a new one."""
        env = self._environment()
        if self.prewarmed is not None:
            prewarmed, self.prewarmed = self.prewarmed, None
            if prewarmed.fits(self.request):
                self.notices = prewarmed.notices
                return prewarmed.hand_over(list(self.request["argv"]), env)
            prewarmed.discard()
        argv = list(self.request["argv"])
        # A home-relative interpreter (python = "~/venv/bin/python") means this node's home:
        # no shell runs the command to expand it.
        argv[0] = os.path.expanduser(argv[0])
        process, self.notices = start_wrapper(argv, env, stdin=subprocess.DEVNULL)
        return process

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.request.get("env", {}))
        env.update(self.request.get("secret_env", {}))
        env.update(
            {
                JOB_ID_VAR: self.job_id,
                NODE_VAR: self.node,
                ATTEMPT_VAR: self.attempt,
                NODE_DIR_VAR: self.node_dir,
                FAILURE_FILE_VAR: self.failure_file,
                progress.PROGRESS_DIR_VAR: self.progress_dir,
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX_TEMPLATE,
            }
        )
        # Worker output goes through files (torchrun's tee): unbuffered, or lines arrive late.
        env.setdefault("PYTHONUNBUFFERED", "1")
        # The NCCL flight recorder (turned on by the plan on GPU nodes) dumps on a timeout into
        # the job's node directory, where `herd logs --stacks` and people look for evidence.
        if "TORCH_NCCL_TRACE_BUFFER_SIZE" in env:
            env.setdefault(
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(self.node_dir, "nccl-trace-rank-")
            )
        return env

    # -- output and progress ------------------------------------------------------------------

    def _pump(self, stream: IO[bytes] | None, name: str) -> None:
        assert stream is not None
        lines = RankLines()
        for raw in iter(stream.readline, b""):
            for rank, local_rank, text in lines.feed(raw.decode(errors="replace").rstrip("\r\n")):
                self._line(name, rank, local_rank, text)
        for rank, local_rank, text in lines.drain():
            self._line(name, rank, local_rank, text)

    def _line(self, name: str, rank: int | None, local_rank: int | None, text: str) -> None:
        if name == "e":
            self.stderr_tails[rank].append(text[:MAX_LINE])
        if rank is not None and local_rank is not None and rank not in self.local_ranks:
            with self._rank_map_lock:
                self.local_ranks[rank] = local_rank
                self._keep_rank_map()
        if not self._sends(name, rank):
            # Kept on this node only (torchrun's own per-rank files); the launcher learns that
            # the rank spoke (progress), not what it said.
            assert rank is not None
            self.spoke.add(rank)
            return
        for start in range(0, max(len(text), 1), MAX_LINE):
            piece = text[start : start + MAX_LINE]
            self.emit({"e": "line", "r": rank, "l": local_rank, "s": name, "t": piece})

    def _worker_ended_badly(self, told: dict[str, Any]) -> None:
        """torchrun's wrapper saw a worker end badly (agent/worker_exits.py): the launcher
        hears it now, to stop the other nodes while torchrun is still ending this one's; not
        once this attempt was asked to stop (its workers' ends are the stop's)."""
        if self.stop_requested.is_set() or self._worker_exit_told:
            return
        self._worker_exit_told = True
        self.emit({"e": "worker-exit", "a": self.attempt, "host": self.node, **told})

    def _sends(self, stream: str, rank: int | None) -> bool:
        """Whether a worker line goes to the launcher: every line unless the request chose
        (large jobs: rank 0, and every rank's stderr), torchrun's own lines always."""
        chosen = self.request.get("send")
        if not isinstance(chosen, dict) or rank is None:
            return True
        ranks = chosen.get("ranks")
        if ranks is None or rank in ranks:
            return True
        return stream == "e" and bool(chosen.get("stderr"))

    def _keep_rank_map(self) -> None:
        """Which global rank ran as which local rank here (``herd logs --rank`` reads the
        lines kept on this node from torchrun's per-local-rank files)."""
        try:
            write_private(
                os.path.join(self.attempt_dir, RANKS_FILE), json.dumps(dict(self.local_ranks))
            )
        except OSError:
            pass

    def _report_progress(self) -> None:
        """Forward each rank's newest beat, phase and committed snapshot to the launcher, and
        which ranks spoke in lines kept here."""
        marks = StartMarks(self.progress_dir, self.attempt, self.emit)
        # On the whole seconds of the wall clock: every node's report reaches the launcher in
        # the same moment, and one wake-up of its event loop reads them all.
        every = float(self.request.get("report_every") or PROGRESS_POLL)
        while not self.stop_requested.wait(every - time.time() % every):
            if self.process is not None and self.process.poll() is not None:
                return
            marks.report()
            beat = self._send_progress()
            if self.spoke:
                spoke, self.spoke = self.spoke, set()
                # A rank whose beat went out just now has shown its progress: its kept lines
                # need telling once only (the launcher counts a rank that spoke as one that
                # joined), so a training node's report is one event, not two.
                news = sorted(r for r in spoke if r not in beat or r not in self.spoke_told)
                self.spoke_told.update(news)
                if news:
                    self.emit({"e": "spoke", "r": news})

    def _send_progress(self) -> set[int]:
        """Report what is new of the ranks' progress; the ranks whose new beat went out."""
        # The reporting thread and the attempt's last report may overlap at the exit.
        with self._progress_lock:
            return self._send_new_progress()

    def _send_new_progress(self) -> set[int]:
        sent = self._progress_sent  # what the reports before this one sent
        # Every rank's new beat in one event: the launcher's work per node stays one event a
        # poll however many ranks the node runs (phases and saves are rare; they go alone).
        ranks = progress.read_progress(self.progress_dir)
        beats: list[list[Any]] = []
        for rank, seen in ranks.items():
            if seen.beat_at is not None and sent.get((rank, "beat")) != seen.beat_at:
                sent[(rank, "beat")] = seen.beat_at
                timings = [seen.compute, seen.wait, seen.cycle, seen.data]
                if seen.totals:
                    # Every step since the last report, not the last write's alone: the file
                    # is rewritten more often than it is read here, and a slowdown that comes
                    # and goes in step with the reads would be missed otherwise.
                    before = sent.get((rank, "totals"), ())
                    timings = progress.mean_since(seen.totals, before)  # type: ignore[arg-type]
                    sent[(rank, "totals")] = seen.totals
                beats.append([rank, seen.step, seen.beat_at, *timings])
        if beats:
            self.emit({"e": "beats", "b": beats})
        for rank, seen in ranks.items():
            if sent.get((rank, "phase")) != seen.phase_since:
                sent[(rank, "phase")] = seen.phase_since
                self.emit(
                    {
                        "e": "phase",
                        "r": rank,
                        "name": seen.phase,
                        "since": seen.phase_since,
                        "limit": seen.phase_limit,
                    }
                )
            if seen.saved_at is not None and sent.get((rank, "saved")) != seen.saved_at:
                sent[(rank, "saved")] = seen.saved_at
                self.emit(
                    {
                        "e": "saved",
                        "r": rank,
                        "step": seen.saved_step,
                        "at": seen.saved_at,
                        "where": seen.saved_where,
                    }
                )
        return {beat[0] for beat in beats}

    # -- stopping -----------------------------------------------------------------------------

    def request_stop(self, why: str = "asked", stacks_first: bool = False) -> None:
        """End the attempt (SIGTERM, grace, SIGKILL); with ``stacks_first`` the workers'
        stacks are taken before they are signalled (evidence while the others stop)."""
        if self.stop_requested.is_set():
            return
        self.why_stopped = why
        self._stacks_before_stop = stacks_first
        self.stop_requested.set()

    def kill_now(self, why: str = "asked") -> None:
        """End the attempt at once: no grace, no stacks (a second Ctrl-C)."""
        self._kill_now.set()
        self.request_stop(why)
        if self.process is not None:
            signal_group(self.process.pid, signal.SIGKILL)
        processes.end_job(self.job_id, self.node, 0, self.attempt)

    def _stop_when_asked(self) -> None:
        self.stop_requested.wait()
        process = self.process
        if process is None or process.poll() is not None:
            return
        if self._stacks_before_stop and not self._kill_now.is_set():
            self.send_stacks("taken as the job stops")
        signal_group(process.pid, signal.SIGTERM)
        grace = 0.0 if self._kill_now.is_set() else self.grace
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            # Workers that outlive their grace period hang somewhere: say where, then kill
            # (whatever became of the evidence: a stop must never hang on it).
            try:
                if not self._kill_now.is_set():
                    self.send_stacks(f"still running {self.grace:g} s after SIGTERM")
            finally:
                signal_group(process.pid, signal.SIGKILL)
        processes.end_job(self.job_id, self.node, 0, self.attempt)

    def send_stacks(self, reason: str) -> None:
        """Emit the stacks of every worker of the attempt on this node (py-spy)."""
        self.emit(
            {
                "e": "stacks",
                "a": self.attempt,
                "host": self.node,
                "reason": reason,
                "at": time.time(),
                # Below this agent (a subreaper) are all of the attempt's processes.
                "workers": stacks.collect(self.job_id, self.node, self.attempt, under=os.getpid()),
            }
        )

    def _reap_orphans(self) -> None:
        """Reap exited orphans that were re-parented to this agent (it is a subreaper): a
        worker's `os.system("... &")` must not leave zombies for the job's whole life. torchrun
        itself is left to Popen.wait(), which needs its exit status."""
        me = os.getpid()
        while self.process is not None and self.process.poll() is None:
            for pid in processes.zombie_children(me):
                if pid != self.process.pid:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
            time.sleep(REAP_EVERY)

    def request_save(self) -> None:
        """Ask the workers to save a snapshot and stop (torchherd.train does at its next log
        step); herd stops the job anyway if they do not."""
        progress.request_save(self.progress_dir)
        self.emit({"e": "save-requested", "a": self.attempt, "host": self.node})

    def _exit_event(self, code: int, survivors: list[int]) -> dict[str, Any]:
        record: dict[str, Any] = {}
        try:
            with open(self.failure_file) as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            pass
        failures = record.get("failures", [])
        for failure in failures:
            failure["last_stderr"] = list(self.stderr_tails.get(failure["rank"], []))
        event: dict[str, Any] = {
            "e": "exit",
            "a": self.attempt,
            "host": self.node,
            "code": code,
            "signal": signal.Signals(-code).name if code < 0 else None,
            "failures": failures,
            "stopped": self.stop_requested.is_set(),
            "why": self.why_stopped,
            "survivors": survivors,
            "node_dir": self.node_dir,
        }
        if record.get("kind") == "launcher":
            event["error"] = {k: record.get(k, "") for k in ("error", "message", "remedy")}
        event["last_stderr"] = list(self.stderr_tails.get(None, []))
        return event


class StartMarks:
    """The attempt's start marks on this node (progress.mark: the wrapper's and each rank's),
    sent to the launcher as they come, until every rank that marked its start has made its
    first step: then no more looks. Each mark is the node's latest of its ranks' (the node is
    through a phase once all its ranks are), on the node's wall clock; the "started" event
    carries that clock's time for the launcher to read them against."""

    def __init__(self, directory: str, attempt: str, emit: Emit) -> None:
        self.directory = directory
        self.attempt = attempt
        self.emit = emit
        self.sent: dict[str, float] = {}
        self.done = False

    def report(self) -> None:
        if self.done:
            return
        found = progress.read_marks(self.directory)
        marks: dict[str, float] = dict(found.pop("wrapper", {}))
        for rank_marks in found.values():
            for name, when in rank_marks.items():
                marks[name] = max(when, marks.get(name, when))
        self.done = bool(found) and all("first-step" in m for m in found.values())
        if marks != self.sent:
            self.sent = marks
            self.emit({"e": "marks", "a": self.attempt, "m": marks, "ranks": len(found)})


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
