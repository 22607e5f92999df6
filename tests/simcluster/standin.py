"""A stand-in for torchrun's wrapper (``python -m torchherd.agent.elastic``), simulated cluster.

The simulated cluster runs herd's real node agents; only torch is stood in for, because a
thousand torch processes do not fit on one machine. A node's ``python`` is a shim that starts
this program where the agent starts torchrun's wrapper, and the real interpreter for everything
else (probe, agent, verbs); or, while the simulated cluster's fork server runs, forks it from
the server (see SHIM below). From the agent's point of view it behaves as the wrapper:

  - it takes torchrun's arguments (``--nnodes``, ``--nproc-per-node``, ... then the script and
    its arguments) or, started with ``--herd-prewarm``, waits for the job on stdin;
  - it starts one worker process per local rank, in a session of its own, with torchrun's
    variables (RANK, LOCAL_RANK, WORLD_SIZE, ...) besides the job's tags; a worker is a
    ``sleep`` (a Python worker per rank would not fit a thousand nodes in memory), and what the
    rank would print and beat is written by this program on its behalf;
  - it prints the ranks' lines prefixed as torchrun's tee does
    (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE), and writes each rank's beat file in
    $HERD_PROGRESS_DIR in torchherd.progress's format;
  - a failed rank (asked for, or a worker that died) ends the job as torchrun does: the other
    workers are stopped, the failure record goes to $HERD_FAILURE_FILE as the wrapper writes
    it, exit code 1;
  - SIGTERM, SIGINT or SIGHUP stop the workers (SIGTERM, then SIGKILL after a grace) and end
    with 128 + the signal, as torchrun under the wrapper does.

What the ranks do is read from the control file (JSON, re-read when it changes), so a benchmark
can change it while the job runs; every key may name the nodes it applies to (``"nodes"``):

  {"lines_per_second": 1, "beats_per_second": 1,       per rank
   "compute_seconds": 0.1,                              beats carry it, as the Trainer's do
   "fail": {"nodes": [3], "local_rank": 1, "exitcode": 1},
   "hang": {"nodes": [2]},                              no more lines or beats
   "silent": {"nodes": [7], "seconds": 30},            the node freezes (agent stopped)
   "finish": true}                                      every rank ends with success

``silent`` freezes the whole node (SIGSTOP to its agent and to this program) for the given
time, as a machine that stops answering; after it the agent finds its link cut and ends the job.
While the control names a frozen node, the other nodes' ranks stop stepping, as the peers of
a frozen rank wait in their collective.

For the benchmark, this program appends what it did to the events file (one line each,
``warm|run|silent|exit NODE WALLTIME [CODE]``; ``warm``: a prewarmed stand-in started).
Standard library only: started on its own, it runs with ``python -S``.
"""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sys
import threading
import time
from typing import Any

PREWARM_FLAG = "--herd-prewarm"
NODE_INDEX_VAR = "SIMCLUSTER_NODE_INDEX"
# Set by every node's shim (cluster.py): the simulated cluster's directory, and the events
# file's name in it.
ROOT_VAR = "SIMCLUSTER_ROOT"
EVENTS_FILE = "events"
# The message torch's elastic agent records for a worker that left no error file.
NO_ERROR_FILE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
# torchrun's own stop: SIGTERM to the workers, SIGKILL after this many seconds.
STOP_GRACE = 5.0
# Seconds between the ranks' lines and beats: short at high rates, long at low ones, so that a
# thousand idle stand-ins on one machine do not take its cores by waking up.
FAST_TICK, SLOW_TICK = 0.1, 1.0
LOOK_EVERY = 0.5
MAX_BEATS_PER_SECOND = 2.0  # torchherd.progress.beat writes at most twice a second
# Forked by the fork server (forkserver.py), this program is not the agent's child: the shell
# shim that asked for it is (it passes on its signals). SHIM is that shell's pid: its parent
# is the node's agent, and a shim that is gone (SIGKILL to its group) ends this program.
SHIM: int | None = None


def parse_torchrun(argv: list[str]) -> dict[str, Any]:
    """The torchrun arguments the plan gives (``--name=value`` until the script), and the rest."""
    options: dict[str, str] = {}
    index = 0
    while index < len(argv) and argv[index].startswith("--"):
        name, _, value = argv[index][2:].partition("=")
        if name == "module":
            options["module"] = "1"
        else:
            options[name] = value
        index += 1
    return {
        "nnodes": int(options.get("nnodes", "1").split(":")[-1]),
        "nproc": int(options.get("nproc-per-node", "1")),
        "endpoint": options.get("rdzv-endpoint", "127.0.0.1:29500"),
        "run_id": options.get("rdzv-id", "none"),
        "script": argv[index:],
    }


def script_options(script: list[str]) -> dict[str, str]:
    """``--control FILE --events FILE --seconds S`` after the job's script name."""
    found: dict[str, str] = {}
    words = script[1:]
    for key, value in zip(words[::2], words[1::2], strict=False):
        if key.startswith("--"):
            found[key[2:]] = value
    return found


class Control:
    """The control file, re-read when its modification time changes."""

    def __init__(self, path: str | None, node: int) -> None:
        self.path = path
        self.node = node
        self.settings: dict[str, Any] = {}
        self._stamp: float | None = None
        self._looked = 0.0

    def refresh(self) -> None:
        now = time.monotonic()
        if not self.path or now - self._looked < LOOK_EVERY:
            return
        self._looked = now
        try:
            stamp = os.stat(self.path).st_mtime
            if stamp == self._stamp:
                return
            with open(self.path) as handle:
                self.settings = json.load(handle)
            self._stamp = stamp
        except (OSError, ValueError):
            pass  # replaced while read: the next look gets it

    def value(self, key: str, default: Any = None) -> Any:
        return self.settings.get(key, default)

    def mine(self, key: str) -> dict[str, Any] | None:
        """A fault entry when it applies to this node (no "nodes": every node)."""
        entry = self.settings.get(key)
        if not entry:
            return None
        if entry is True:
            return {}
        nodes = entry.get("nodes")
        return entry if nodes is None or self.node in nodes else None


class StandIn:
    """One node's torchrun wrapper, stood in for."""

    def __init__(self, argv: list[str]) -> None:
        args = parse_torchrun(argv)
        self.node = int(os.environ.get(NODE_INDEX_VAR, "0"))
        self.nproc: int = args["nproc"]
        self.world = args["nnodes"] * self.nproc
        self.base_rank = self.node * self.nproc
        self.endpoint: str = args["endpoint"]
        self.run_id: str = args["run_id"]
        options = script_options(args["script"])
        self.control = Control(options.get("control"), self.node)
        self.events = options.get("events")
        self.seconds = float(options.get("seconds", "0"))
        self.progress_dir = os.environ.get("HERD_PROGRESS_DIR")
        self.failure_file = os.environ.get("HERD_FAILURE_FILE")
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "")
        self.prefixes = [
            string.Template(template).safe_substitute(rank=self.base_rank + local, local_rank=local)
            for local in range(self.nproc)
        ]
        self.workers: list[subprocess.Popen[bytes]] = []
        self.stop_signal: int | None = None
        self.steps = [0] * self.nproc
        self.lines_due = [0.0] * self.nproc
        self.beats_due = [0.0] * self.nproc
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()
        self.frozen = False

    # -- the workers -----------------------------------------------------------------------

    def start_workers(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        for local in range(self.nproc):
            env = dict(os.environ)
            env.update(
                {
                    "RANK": str(self.base_rank + local),
                    "LOCAL_RANK": str(local),
                    "GROUP_RANK": str(self.node),
                    "ROLE_RANK": str(self.base_rank + local),
                    "WORLD_SIZE": str(self.world),
                    "LOCAL_WORLD_SIZE": str(self.nproc),
                    "MASTER_ADDR": host.strip("[]"),
                    "MASTER_PORT": port,
                    "TORCHELASTIC_RUN_ID": self.run_id,
                    "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0",
                }
            )
            self.workers.append(
                subprocess.Popen(
                    ["sleep", "infinity"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # as torchrun starts its workers
                )
            )

    def stop_workers(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    def dead_worker(self) -> tuple[int, int] | None:
        """(local rank, exit status) of a worker that died on its own."""
        for local, worker in enumerate(self.workers):
            code = worker.poll()
            if code is not None:
                return local, code
        return None

    # -- what the ranks do -------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        with self.lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, OSError):
                pass  # the agent is gone; its teardown ends this program

    def tick(self, elapsed: float) -> None:
        rate = float(self.control.value("lines_per_second", 1.0))
        beats = min(float(self.control.value("beats_per_second", 1.0)), MAX_BEATS_PER_SECOND)
        chunk: list[str] = []
        now = time.time()
        for local in range(self.nproc):
            self.lines_due[local] += rate * elapsed
            while self.lines_due[local] >= 1.0:
                self.lines_due[local] -= 1.0
                self.steps[local] += 1
                chunk.append(
                    f"{self.prefixes[local]}step {self.steps[local]} loss 0.{local}42 "
                    f"at={now:.3f}\n"
                )
            self.beats_due[local] += beats * elapsed
            if self.beats_due[local] >= 1.0:
                self.beats_due[local] = 0.0
                compute = self.control.value("compute_seconds", None)
                self.beat(self.base_rank + local, self.steps[local], now, compute)
        if chunk:
            self.write("".join(chunk).encode())

    def beat(self, rank: int, step: int, now: float, compute: object = None) -> None:
        if not self.progress_dir:
            return
        path = os.path.join(self.progress_dir, f"rank-{rank}")
        temporary = f"{path}.{os.getpid()}.tmp"
        work = f" {float(compute):.6f}" if isinstance(compute, int | float) else ""
        try:
            with open(temporary, "w") as handle:
                handle.write(f"{step} {now:.3f}{work}\n")
            os.replace(temporary, path)
        except OSError:
            pass

    def event(self, *words: object) -> None:
        if self.events:
            append_event(self.events, *words)

    def freeze(self, seconds: float) -> None:
        """The whole node stops answering: its agent and this program stop for ``seconds``."""
        agent = os.getppid() if SHIM is None else parent(SHIM)
        if agent is None:
            return  # the node is going already
        self.event("silent", self.node)
        os.kill(agent, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(agent, signal.SIGCONT)

    # -- the run -----------------------------------------------------------------------------

    def fail(self, local: int, exitcode: int, reason: str) -> int:
        rank = self.base_rank + local
        pid = self.workers[local].pid if self.workers else 0
        self.write(f"{self.prefixes[local]}RuntimeError: {reason}\n".encode())
        self.stop_workers()
        record = {
            "kind": "workers",
            "failures": [
                {
                    "rank": rank,
                    "local_rank": local,
                    "pid": pid,
                    "exitcode": exitcode,
                    "signal": signal.Signals(-exitcode).name if exitcode < 0 else None,
                    "message": NO_ERROR_FILE,
                    "timestamp": int(time.time()),
                    "recorded": False,
                }
            ],
        }
        if self.failure_file:
            fd = os.open(self.failure_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(record))
        print(
            f"E torch.distributed.elastic.multiprocessing.api: failed (exitcode: {exitcode}) "
            f"local_rank: {local} (pid: {pid}) of binary: {sys.executable}",
            file=sys.stderr,
        )
        print(f"torchherd: workers failed: {NO_ERROR_FILE}", file=sys.stderr, flush=True)
        return 1

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.start_workers()
        self.event("run", self.node)
        started = last = time.monotonic()
        code = 0
        while True:
            fast = float(self.control.value("lines_per_second", 1.0)) > 1 / SLOW_TICK
            time.sleep(FAST_TICK if fast else SLOW_TICK)
            now = time.monotonic()
            if self.stop_signal is None and SHIM is not None and parent(SHIM) is None:
                self.stop_signal = signal.SIGKILL  # the agent killed torchrun's process group
            if self.stop_signal is not None:
                self.stop_workers()
                name = signal.Signals(self.stop_signal).name
                print(f"torchherd: torchrun stopped by {name}", file=sys.stderr, flush=True)
                code = 128 + self.stop_signal
                break
            self.control.refresh()
            died = self.dead_worker()
            if died is not None:
                local, status = died
                code = self.fail(local, status, "worker process exited")
                break
            failing = self.control.mine("fail")
            if failing is not None:
                local = int(failing.get("local_rank", 0)) % self.nproc
                code = self.fail(local, int(failing.get("exitcode", 1)), "simulated failure")
                break
            silent = self.control.mine("silent")
            if silent is not None and not self.frozen:
                self.frozen = True
                self.freeze(float(silent.get("seconds", 30)))
                last = time.monotonic()
                continue
            finished = self.control.mine("finish") is not None
            if finished or (self.seconds and now - started >= self.seconds):
                self.stop_workers()
                break
            # A frozen peer holds a synchronous job's collectives: the other nodes' ranks stop
            # stepping with it (herd reads their steps as proof that a quiet node takes part).
            peer_frozen = self.control.value("silent") is not None
            if self.control.mine("hang") is None and not peer_frozen:
                self.tick(now - last)
            last = now
        self.event("exit", self.node, code)
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum


def append_event(path: str, *words: object) -> None:
    """One line of the events file: the words, then the wall time."""
    line = " ".join(str(w) for w in words) + f" {time.time():.3f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def parent(pid: int) -> int | None:
    """The parent of a live process; None once it has ended (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[1])


def prewarmed() -> int:
    """As the wrapper's --herd-prewarm: wait for the job on stdin, then run it. Says "warm"
    in the events file first: the node's agent is up from then on (a benchmark counts what
    the nodes up so far cost the launcher while the others start)."""
    root = os.environ.get(ROOT_VAR)
    if root:
        append_event(os.path.join(root, EVENTS_FILE), "warm", os.environ.get(NODE_INDEX_VAR, "0"))
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return StandIn(list(job["argv"])).run()


def main(argv: list[str]) -> int:
    if argv == [PREWARM_FLAG]:
        return prewarmed()
    return StandIn(argv).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
