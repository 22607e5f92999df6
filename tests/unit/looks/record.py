"""Record real looks (agent.look) at jobs in known states, for the hang watch's unit tests.

Each scenario starts a real 2-rank torchrun job on this machine (Gloo, CPU), tagged the way a
node agent tags its job, brings it into a known state (a rank stopped, a rank blocked, every
rank computing in silence, rank 0 saving while the other waits, ...), then takes looks every
few seconds with the agent's own code and writes them to ``<scenario>.json``:

    {"scenario": ..., "world_size": 2, "looks": [{"t": seconds since the first look,
                                                   "event": the agent's look event}, ...]}

The unit tests replay these on a test clock. Run again after changing agent.look:

    python tests/unit/looks/record.py [SCENARIO...]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchherd.agent.look import look_event
from torchherd.agent.processes import end_job

HERE = Path(__file__).resolve().parent
JOB, NODE = "looks", "node1"

# The worker: prints READY with its pid once the scenario's state begins.
WORKER = r"""
import os, sys, time, threading, torch, torch.distributed as dist
scenario = sys.argv[1]
rank = int(os.environ["RANK"])
def ready():
    print(f"READY rank={rank} pid={os.getpid()}", flush=True)
if scenario == "stopped-before-init":
    ready()
    time.sleep(2)
dist.init_process_group("gloo")
v = torch.ones(1)
for _ in range(5):
    dist.all_reduce(v)
if scenario in ("stopped-mid-run", "stopped-before-init"):
    if scenario == "stopped-mid-run":
        ready()
    while True:
        dist.all_reduce(v)
        time.sleep(0.05)
elif scenario == "blocked-rank":
    ready()
    if rank == 1:
        lock = threading.Lock(); lock.acquire(); lock.acquire()
    dist.all_reduce(v)
elif scenario == "silent-compute":
    ready()
    x = torch.randn(400, 400)
    end = time.time() + 600
    while time.time() < end:
        x = torch.tanh(x @ x / 400)
elif scenario == "silent-save":
    ready()
    if rank == 0:
        path = os.path.join(os.environ["SAVE_DIR"], "big.bin")
        block = os.urandom(1 << 20)
        with open(path, "wb") as out:
            for _ in range(2000):  # about 20 MB/s: a save to a slow disk, in silence
                out.write(block)
                os.fsync(out.fileno())
                time.sleep(0.05)
    dist.barrier()
elif scenario == "all-waiting":
    ready()
    # Each rank waits for the other to send first: every rank waits, forever.
    dist.recv(v, src=1 - rank)
elif scenario == "dataloader-wait":
    ready()
    from torch.utils.data import DataLoader, Dataset
    class Slow(Dataset):
        def __len__(self): return 1000
        def __getitem__(self, i):
            end = time.time() + 2
            x = 0.0
            while time.time() < end:
                x += 1.0
            return torch.ones(1)
    for batch in DataLoader(Slow(), batch_size=8, num_workers=1):
        dist.all_reduce(batch)
elif scenario == "loader-pool-read":
    from concurrent.futures import ThreadPoolExecutor
    from torch.utils.data import DataLoader, Dataset
    class Fetched(Dataset):
        # Rank 1's worker fetches its third batch through a thread pool, from a server that
        # sends a byte a second: its main thread waits on a lock for the pool's thread.
        def __len__(self): return 1000
        def __getitem__(self, i):
            if rank == 1 and i >= 16:
                import urllib.request
                def fetch():
                    with urllib.request.urlopen(os.environ["SLOW_URL"]) as answer:
                        return answer.read()
                with ThreadPoolExecutor(2) as pool:
                    pool.submit(fetch).result()
            return torch.ones(1)
    ready()
    for batch in DataLoader(Fetched(), batch_size=8, num_workers=1):
        dist.all_reduce(batch)
elif scenario in ("loader-stuck", "loader-sleep"):
    from torch.utils.data import DataLoader, Dataset
    class Held(Dataset):
        # Rank 1's worker stops at its third batch: blocked for ever on a lock (as on one
        # another thread held at the fork), or in a long sleep (a slow source's backoff).
        def __len__(self): return 1000
        def __getitem__(self, i):
            if rank == 1 and i >= 16:
                if scenario == "loader-stuck":
                    lock = threading.Lock(); lock.acquire(); lock.acquire()
                time.sleep(600)
            return torch.ones(1)
    ready()
    for batch in DataLoader(Held(), batch_size=8, num_workers=1):
        dist.all_reduce(batch)
elif scenario == "socket-wait":
    ready()
    if rank == 0:  # a download from a server that sends a byte a second
        import urllib.request
        with urllib.request.urlopen(os.environ["SLOW_URL"]) as answer:
            answer.read()
    dist.barrier()
elif scenario == "backoff-sleep":
    ready()
    if rank == 1:
        time.sleep(600)  # a retry's backoff
    dist.all_reduce(v)
elif scenario == "lock-wait":
    ready()
    if rank == 1:  # another process holds the lock (main_process_first, a cache's lock)
        import fcntl
        with open(os.environ["LOCK_FILE"], "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
    dist.barrier()
elif scenario == "phase-deadlock":
    from torchherd.progress import phase
    ready()
    if rank == 1:
        with phase("saving"):
            lock = threading.Lock(); lock.acquire(); lock.acquire()
    dist.barrier()
elif scenario == "never-exits":
    ready()
    dist.barrier()
    if rank == 1:  # a non-daemon thread that waits forever: the interpreter never exits
        threading.Thread(target=threading.Event().wait).start()
    print(f"DONE rank={rank}", flush=True)
"""

# A server that answers one byte a second (a slow mirror), for "socket-wait".
SLOW_SERVER = r"""
import http.server, sys, time
class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "1000"); self.end_headers()
        for _ in range(1000):
            self.wfile.write(b"x"); self.wfile.flush(); time.sleep(1)
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

SCENARIOS = {
    # name: (what to do to which rank once READY, looks to take)
    "stopped-mid-run": ("stop", 1, 4),
    "stopped-before-init": ("stop", 1, 4),
    "blocked-rank": (None, None, 5),
    "silent-compute": (None, None, 4),
    "silent-save": (None, None, 4),
    "all-waiting": (None, None, 4),
    "dataloader-wait": (None, None, 4),
    "loader-stuck": (None, None, 4),
    "loader-sleep": (None, None, 4),
    "loader-pool-read": (None, None, 4),
    "socket-wait": (None, None, 4),
    "backoff-sleep": (None, None, 4),
    "lock-wait": (None, None, 4),
    "phase-deadlock": (None, None, 4),
    "never-exits": (None, None, 4),
}
LOOK_EVERY = 5.0


def record(name: str) -> None:
    action, victim, looks = SCENARIOS[name]
    attempt = name  # each scenario's processes are its own
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        helpers = []
        server = subprocess.Popen(
            [sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True
        )
        helpers.append(server)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        lock_file = Path(tmp) / "held.lock"
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import fcntl, sys, time\nf = open(sys.argv[1], 'w')\n"
                "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(900)",
                str(lock_file),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        helpers.append(holder)
        assert holder.stdout is not None
        holder.stdout.readline()
        progress_dir = Path(tmp) / "progress"
        progress_dir.mkdir()
        env = dict(
            os.environ,
            HERD_JOB_ID=JOB,
            HERD_NODE=NODE,
            HERD_ATTEMPT=attempt,
            SAVE_DIR=tmp,
            SLOW_URL=f"http://127.0.0.1:{port}/data",
            LOCK_FILE=str(lock_file),
            HERD_PROGRESS_DIR=str(progress_dir),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(script),
                name,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            pids: dict[int, int] = {}
            assert job.stdout is not None
            for line in job.stdout:
                # Both ranks' lines can share one (each print is two writes: text, newline).
                for found in re.finditer(r"READY rank=(\d+) pid=(\d+)", line):
                    pids[int(found.group(1))] = int(found.group(2))
                if len(pids) == 2:
                    break
            if name == "never-exits":  # wait until rank 0 has exited, rank 1 has not
                for line in job.stdout:
                    if line.startswith("DONE rank=1"):
                        break
                time.sleep(2)
            if action == "stop":
                os.kill(pids[victim], signal.SIGSTOP)
            time.sleep(3)
            taken = []
            start = time.monotonic()
            for _ in range(looks):
                event = look_event(JOB, NODE, attempt, str(progress_dir))
                taken.append({"t": round(time.monotonic() - start, 2), "event": event})
                time.sleep(LOOK_EVERY)
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        finally:
            # Workers run in sessions of their own: end every process of the scenario by tag.
            end_job(JOB, NODE, 0, attempt)
            job.wait()
            for helper in helpers:
                helper.kill()
                helper.wait()
    out = {"scenario": name, "world_size": 2, "looks": taken}
    (HERE / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    kinds = [
        [(r["rank"], r["state"], (r.get("frames") or ["-"])[0]) for r in t["event"]["ranks"]]
        for t in taken
    ]
    print(name, kinds[-1], flush=True)


if __name__ == "__main__":
    for chosen in sys.argv[1:] or list(SCENARIOS):
        record(chosen)
