"""`python -m torchherd.agent run`: run one node's share of a job and report on it.

The agent reads the job request (argv, env, secrets) as the first JSON line of stdin, starts the
command (the torchrun wrapper) in a session of its own, streams every output line back as an
event, and ends the whole job on this node when:
  - stdin closes (the launcher died or its ssh link dropped),
  - it is told to ({"cmd": "stop"}), or it gets SIGTERM, SIGINT or SIGHUP,
  - the command exits (leftovers of the job are swept).
Ending = SIGTERM to torchrun (which stops its workers), then after the grace period the stacks
of the workers still there (evidence of where they hung), then SIGKILL to every process tagged
with this job and node. Its last event says how the command ended.

Liveness both ways: the launcher pings, and silence for ``silence`` seconds (a partition closes
nothing) makes the agent end the job; the agent says {"e": "alive"} every ALIVE_EVERY seconds,
so the launcher notices a silent node just as fast.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from .. import progress
from ..files import private_dir
from . import processes, stacks
from .control import write_agent_record
from .elastic import FAILURE_FILE_VAR, NODE_DIR_VAR, PREWARM_FLAG
from .protocol import ATTEMPT_VAR, JOB_ID_VAR, LINE_PREFIX_TEMPLATE, NODE_VAR, RankLines, encode

Emit = Callable[[dict[str, Any]], None]

# Lines of stderr kept per rank for the failure summary.
STDERR_TAIL = 20
# Missed launcher pings after which an attached agent ends its job (when the request does not
# say how long a silence means the launcher is gone).
HEARTBEAT_MISSES = 6
# Seconds between the agent's own "alive" events.
ALIVE_EVERY = 2.0
# Longest text of one line event; longer worker lines travel in pieces (the launcher's reader
# and its memory stay bounded, whatever a worker prints).
MAX_LINE = 64 * 1024
# Seconds between looks for exited orphans to reap.
REAP_EVERY = 1.0
# Seconds between looks at the workers' beat files.
BEAT_POLL = 1.0


def herd_home(env: dict[str, str]) -> str:
    return os.path.expanduser(env.get("HERD_HOME") or os.environ.get("HERD_HOME") or "~/.herd")


ELASTIC_MODULE = "torchherd.agent.elastic"


class Prewarmed:
    """torchrun's wrapper, started before the job request arrives so that its torch import
    overlaps the launcher's probe and plan (a launch is then as fast as torchrun by hand)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.python = str(spec["python"])
        self.workdir = spec.get("workdir")
        cwd = os.path.expanduser(self.workdir) if self.workdir else None
        env = dict(os.environ)
        env.update(
            {
                JOB_ID_VAR: str(spec["job_id"]),
                NODE_VAR: str(spec["node"]),
                ATTEMPT_VAR: str(spec.get("attempt", 0)),
            }
        )
        env.setdefault("PYTHONUNBUFFERED", "1")
        processes.become_subreaper()
        self.process = subprocess.Popen(
            [self.python, "-m", ELASTIC_MODULE, PREWARM_FLAG],
            env=env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def fits(self, request: dict[str, Any]) -> bool:
        argv = list(request.get("argv", []))
        return (
            argv[:3] == [self.python, "-m", ELASTIC_MODULE]
            and request.get("workdir") == self.workdir
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
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()


class NodeJob:
    """One node's part of one job: the process, its output pumps and its teardown."""

    def __init__(
        self, request: dict[str, Any], emit: Emit, prewarmed: Prewarmed | None = None
    ) -> None:
        self.request = request
        self.emit = emit
        self.prewarmed = prewarmed
        self.job_id: str = request["job_id"]
        self.node: str = request["node"]
        self.grace: float = float(request.get("grace", 10))
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_requested = threading.Event()
        self.stderr_tails: dict[int | None, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=STDERR_TAIL)
        )
        env = dict(request.get("env", {}))
        self.node_dir = os.path.join(herd_home(env), "nodes", self.job_id, self.node)
        self.failure_file = os.path.join(self.node_dir, "failure.json")
        self.progress_dir = os.path.join(self.node_dir, "progress")

    def run(self) -> int:
        workdir = self.request.get("workdir")
        if workdir:
            path = os.path.expanduser(workdir)
            if not os.path.isdir(path):
                self.emit(
                    {
                        "e": "error",
                        "message": f"working directory {path} does not exist on {self.node}",
                        "remedy": "copy the project there with `herd sync`, or set [cluster] "
                        "workdir to a directory that exists on every node",
                    }
                )
                return 3
            os.chdir(path)
        private_dir(self.progress_dir, home=herd_home(dict(self.request.get("env", {}))))
        # Where `herd stop` (from any terminal) finds this agent to end the job cleanly.
        write_agent_record(
            self.node_dir,
            self.job_id,
            self.node,
            bool(self.request.get("detach")),
            attempt=self.request.get("env", {}).get(ATTEMPT_VAR),
        )
        processes.become_subreaper()
        try:
            self.process = self._start()
        except OSError as exc:
            self.emit(
                {
                    "e": "error",
                    "message": f"cannot start {self.request['argv'][0]} on {self.node}: {exc}",
                    "remedy": "check [cluster] python (or the node's python) in herd.toml",
                }
            )
            return 3
        self.emit(
            {"e": "started", "host": self.node, "pid": self.process.pid, "node_dir": self.node_dir}
        )
        pumps = [
            threading.Thread(target=self._pump, args=(self.process.stdout, "o"), daemon=True),
            threading.Thread(target=self._pump, args=(self.process.stderr, "e"), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        threading.Thread(target=self._stop_when_asked, daemon=True).start()
        threading.Thread(target=self._report_beats, daemon=True).start()
        threading.Thread(target=self._reap_orphans, daemon=True).start()
        code = self.process.wait()
        for pump in pumps:
            pump.join(timeout=5)
        survivors = processes.end_job(self.job_id, self.node, grace=min(self.grace, 5))
        self.emit(self._exit_event(code, survivors))
        return 130 if self.stop_requested.is_set() else (0 if code == 0 else 1)

    def _start(self) -> subprocess.Popen[bytes]:
        """torchrun's wrapper for this job: the prewarmed one when it fits, else a new one."""
        env = self._environment()
        if self.prewarmed is not None:
            if self.prewarmed.fits(self.request):
                return self.prewarmed.hand_over(list(self.request["argv"]), env)
            self.prewarmed.discard()
        return subprocess.Popen(
            self.request["argv"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.request.get("env", {}))
        env.update(self.request.get("secret_env", {}))
        env.update(
            {
                JOB_ID_VAR: self.job_id,
                NODE_VAR: self.node,
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
        for start in range(0, max(len(text), 1), MAX_LINE):
            piece = text[start : start + MAX_LINE]
            self.emit({"e": "line", "r": rank, "l": local_rank, "s": name, "t": piece})

    def _stop_when_asked(self) -> None:
        self.stop_requested.wait()
        process = self.process
        if process is None or process.poll() is not None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            # Workers that outlive their grace period hang somewhere: say where, then kill.
            self.send_stacks(f"still running {self.grace:g} s after SIGTERM")
            _signal_group(process.pid, signal.SIGKILL)
        processes.end_job(self.job_id, self.node, grace=0)

    def send_stacks(self, reason: str) -> None:
        """Emit the stacks of every worker of the job on this node (py-spy)."""
        self.emit(
            {
                "e": "stacks",
                "host": self.node,
                "reason": reason,
                "at": time.time(),
                "workers": stacks.collect(self.job_id, self.node),
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

    def request_stop(self) -> None:
        self.stop_requested.set()

    def request_save(self) -> None:
        """Ask the workers to save a snapshot and stop (torchherd.train does at its next log
        step); herd stops the job anyway if they do not."""
        progress.request_save(self.progress_dir)
        self.emit({"e": "save-requested", "host": self.node})

    def _report_beats(self) -> None:
        """Forward each rank's newest beat (torchherd.progress.beat) to the launcher."""
        sent: dict[int, tuple[int | None, float]] = {}
        while not self.stop_requested.wait(BEAT_POLL):
            if self.process is not None and self.process.poll() is not None:
                return
            for rank, beat in progress.read_beats(self.progress_dir).items():
                if sent.get(rank) != beat:
                    sent[rank] = beat
                    self.emit({"e": "beat", "r": rank, "step": beat[0], "at": beat[1]})

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
            "host": self.node,
            "code": code,
            "signal": signal.Signals(-code).name if code < 0 else None,
            "failures": failures,
            "stopped": self.stop_requested.is_set(),
            "survivors": survivors,
            "node_dir": self.node_dir,
        }
        if record.get("kind") == "launcher":
            event["error"] = {k: record.get(k, "") for k in ("error", "message", "remedy")}
        event["last_stderr"] = list(self.stderr_tails.get(None, []))
        return event


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class StdoutEmitter:
    """Writes events to stdout; a broken pipe means the launcher is gone, so the job stops."""

    def __init__(self, on_broken: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._on_broken = on_broken
        self._broken = False

    def __call__(self, event: dict[str, Any]) -> None:
        data = encode(event)
        with self._lock:
            if self._broken:
                return
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except (BrokenPipeError, OSError):
                self._broken = True
                self._on_broken()


def main() -> int:
    try:
        request = json.loads(sys.stdin.buffer.readline())
        prewarmed = None
        if "prewarm" in request:
            # The launcher opened this session before planning: start torchrun's wrapper now
            # (it imports torch meanwhile), then wait for the real request.
            prewarmed = Prewarmed(request["prewarm"])
            line = sys.stdin.buffer.readline()
            request = json.loads(line) if line.strip() else {}
            if "job_id" not in request:  # stdin closed or "stop": the launch did not happen
                prewarmed.discard()
                return 0
    except ValueError:
        print("torchherd agent: expected a JSON job request on stdin", file=sys.stderr)
        return 2
    if request.get("detach"):
        # Before any thread starts: the daemon is made with fork().
        from .detach import run_detached

        return run_detached(request)
    job: NodeJob | None = None

    def stop(*_: object) -> None:
        if job is not None:
            job.request_stop()

    emitter = StdoutEmitter(on_broken=stop)
    job = NodeJob(request, emitter, prewarmed)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    nodejob = job
    # SIGPIPE stays ignored (Python's default), so a dead launcher shows up as BrokenPipeError.

    last_heard = [time.monotonic()]

    def watch_stdin() -> None:
        for line in sys.stdin.buffer:
            last_heard[0] = time.monotonic()
            try:
                command = json.loads(line).get("cmd")
            except (ValueError, AttributeError):
                continue
            if command == "stop":
                break
            if command == "save":
                nodejob.request_save()
            elif command == "stacks":
                threading.Thread(
                    target=nodejob.send_stacks, args=("asked by the launcher",), daemon=True
                ).start()
        stop()  # "stop", or stdin closed: the launcher is gone

    def say_alive() -> None:
        while not nodejob.stop_requested.wait(ALIVE_EVERY):
            emitter({"e": "alive"})

    def watch_heartbeat(interval: float) -> None:
        # A partition closes nothing: sshd may keep stdin open for hours. The launcher pings
        # every `interval` s; silence for `limit` s means it is gone or cut off.
        limit = float(request.get("silence") or max(interval * HEARTBEAT_MISSES, 15.0))
        while not nodejob.stop_requested.wait(interval):
            if time.monotonic() - last_heard[0] > limit:
                print(
                    f"torchherd agent: no word from the launcher for {limit:.0f} s; "
                    "stopping the job",
                    file=sys.stderr,
                    flush=True,
                )
                stop()
                return

    threading.Thread(target=watch_stdin, daemon=True).start()
    threading.Thread(target=say_alive, daemon=True).start()
    if request.get("heartbeat"):
        threading.Thread(
            target=watch_heartbeat, args=(float(request["heartbeat"]),), daemon=True
        ).start()
    return job.run()
