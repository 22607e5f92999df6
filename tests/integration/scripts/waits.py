"""Test job: ranks that wait on the world outside the job, a rank deadlocked inside a phase,
a rank that never exits. Prints `STEPPING rank=R` after its first all-reduce, then each wait
is silent (no output, no beat):

--download S   rank 0 reads from an HTTP server on its own node's loopback that sends one
               byte a second, for S s, while the others wait in a barrier
--backoff S    rank 1 sleeps S s (a retry's backoff) while the others wait in an all-reduce
--lock S       the last rank blocks on a file lock that another process holds for S s, while
               the others wait in a barrier
--together     the download and the lock at once (one wait, shorter runs): rank 1 waits in
               the barrier for both
--disk-wait S  rank 1 is in state D (uninterruptible, as on a slow NFS or Lustre mount) for
               S s, while the others wait in a barrier: its main thread clones a child that
               shares its memory (CLONE_VM | CLONE_VFORK, as vfork) and sleeps; the kernel
               holds the parent in a killable disk wait until the child exits
--deadlock-in-phase
               rank 1 deadlocks (takes a lock it holds) inside phase("saving") while the
               others wait in a barrier
--never-exit   rank 1 starts a non-daemon thread that waits for ever, then finishes its script:
               its interpreter never exits
--loader-stuck every rank reads batches through a DataLoader worker process, all-reducing
               each; rank 1's worker blocks for ever on a lock at its third batch (as on a
               lock another thread held when the worker was forked), while its rank waits for
               the batch and the others wait in the all-reduce
Rank 0 prints `WAIT <name>` before each of these waits and `WAITED <name>` once every rank
is past it (for bench/recovery.py to tell which wait a verdict came in). Prints `DONE rank=R`
at the end.
"""

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from torchherd.progress import phase

parser = argparse.ArgumentParser()
parser.add_argument("--download", type=float, default=0)
parser.add_argument("--backoff", type=float, default=0)
parser.add_argument("--lock", type=float, default=0)
parser.add_argument("--together", action="store_true")
parser.add_argument("--disk-wait", type=int, default=0)
parser.add_argument("--deadlock-in-phase", action="store_true")
parser.add_argument("--never-exit", action="store_true")
parser.add_argument("--loader-stuck", action="store_true")
args = parser.parse_args()

SLOW_SERVER = r"""
import http.server, sys, time
class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        size = int(self.path.strip("/"))
        self.send_response(200); self.send_header("Content-Length", str(size)); self.end_headers()
        for _ in range(size):
            self.wfile.write(b"x"); self.wfile.flush(); time.sleep(1)
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", 0), Slow)
print(server.server_address[1], flush=True)
server.handle_request()
"""
HOLDER = r"""
import fcntl, sys, time
held = open(sys.argv[1], "w")
fcntl.flock(held, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def disk_wait(seconds: int) -> None:
    """This thread in state D for ``seconds`` (see --disk-wait)."""
    libc = ctypes.CDLL(None, use_errno=True)
    stack = ctypes.create_string_buffer(64 * 1024)
    top = ctypes.c_void_p(ctypes.addressof(stack) + len(stack) - 64)
    clone_vm, clone_vfork, sigchld = 0x100, 0x4000, 17
    libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)
    pid = libc.clone(sleep, top, clone_vm | clone_vfork | sigchld, ctypes.c_void_p(seconds))
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone")
    os.waitpid(pid, 0)


def download(seconds: float) -> None:
    """Rank 0 reads ``seconds`` bytes from a server that sends one a second."""
    import urllib.request

    server = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True
    )
    port = int(server.stdout.readline())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{int(seconds)}") as answer:
        answer.read()
    server.wait()


def wait_on_lock(seconds: float) -> None:
    """Block on a file lock another process holds for ``seconds``."""
    import fcntl

    path = os.path.join(tempfile.gettempdir(), f"waits-{os.getpid()}.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, path, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    holder.stdout.readline()
    with open(path, "w") as mine:
        fcntl.flock(mine, fcntl.LOCK_EX)  # blocks until the holder lets go
    holder.wait()
    os.unlink(path)


def read_through_a_stuck_loader() -> None:
    """See --loader-stuck."""
    from torch.utils.data import DataLoader, Dataset

    class Held(Dataset):
        def __len__(self) -> int:
            return 1000

        def __getitem__(self, index: int) -> torch.Tensor:
            if rank == 1 and index >= 16:
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()
            return torch.ones(1)

    for batch in DataLoader(Held(), batch_size=8, num_workers=1):
        dist.all_reduce(batch)


def mark(word: str, name: str) -> None:
    if rank == 0:
        print(f"{word} {name}", flush=True)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.ones(1)
for _ in range(5):
    dist.all_reduce(value)
print(f"STEPPING rank={rank}", flush=True)

if args.download:
    mark("WAIT", "download+lock" if args.together else "download")
    if rank == 0:
        download(args.download)
    if args.together and rank == world - 1:
        wait_on_lock(args.lock)
    dist.barrier()
    mark("WAITED", "download+lock" if args.together else "download")
if args.backoff:
    mark("WAIT", "backoff")
    if rank == 1:
        time.sleep(args.backoff)
    dist.all_reduce(value)
    mark("WAITED", "backoff")
if args.lock and not args.together:
    mark("WAIT", "lock")
    if rank == world - 1:
        wait_on_lock(args.lock)
    dist.barrier()
    mark("WAITED", "lock")
if args.disk_wait:
    mark("WAIT", "disk")
    if rank == 1:
        disk_wait(args.disk_wait)
    dist.barrier()
    mark("WAITED", "disk")
if args.loader_stuck:
    read_through_a_stuck_loader()
if args.deadlock_in_phase:
    if rank == 1:
        with phase("saving"):
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()
    dist.barrier()
print(f"DONE rank={rank}", flush=True)
if args.never_exit:
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        threading.Thread(target=threading.Event().wait).start()
    sys.exit(0)
dist.barrier()
dist.destroy_process_group()
