"""Process-group setup from the variables torchrun sets, so one script runs on 1 or N processes.

``setup()`` reads only RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and GROUP_RANK (torchrun's
contract; MASTER_ADDR/PORT are read by ``init_process_group`` itself). Without them it returns a
single-process context and creates no process group, so the same file also runs under plain
``python``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from torchherd.exit_guard import let_threads_finish

__all__ = ["Context", "setup", "teardown"]


@dataclass(frozen=True, slots=True)
class Context:
    """Where this process sits in the job, and the device it computes on."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    local_rank: int
    """Rank among the processes of this node; picks the GPU."""
    world_size: int
    """Number of processes in the job."""
    device: torch.device
    """``cuda:<local_rank>`` when a GPU is there for this rank, else ``cpu``."""
    local_world_size: int = 1
    """Number of processes on this node."""
    node_rank: int = 0
    """Index of this node in the job (torchrun's GROUP_RANK); not stable across restarts."""
    backend: str | None = None
    """Process-group backend (``nccl`` or ``gloo``), or None when running as one process."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one process that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0: the one process per node that writes node-local files."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is initialised (collectives are available)."""
        return self.backend is not None and dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        """Wait for every rank; a no-op when running as one process."""
        if self.distributed:
            dist.barrier()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(backend: str | None = None, timeout: timedelta | None = None) -> Context:
    """Join the job's process group (when launched by torchrun) and choose this rank's device.

    The backend is NCCL when this rank has a GPU and Gloo otherwise, unless ``backend`` says.
    Calling it when a process group already exists (Accelerate, Lightning, a second call) adopts
    that group instead of creating another one.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    node_rank = _env_int("GROUP_RANK", 0)
    device = _pick_device(local_rank)
    if device.type == "cuda":
        # Before the process group: NCCL binds its communicator to the current device.
        torch.cuda.set_device(device)

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if dist.is_available() and dist.is_initialized():
        chosen: str | None = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    elif launched:
        chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs: dict[str, object] = {"backend": chosen, "rank": rank, "world_size": world_size}
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(**kwargs)  # type: ignore[arg-type]
    else:
        chosen = None
    return Context(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        local_world_size=local_world_size,
        node_rank=node_rank,
        backend=chosen,
    )


def teardown(barrier: bool = True) -> None:
    """Leave the process group, if one exists; safe to call more than once.

    The barrier first lets every rank finish its last collective. Without it, a process group
    still referenced by a DDP or FSDP model is destroyed later, at interpreter exit, while a
    Gloo thread may still need the GIL to release the last collective's tensors: the process
    then hangs on exit (seen with torch 2.13). Pass ``barrier=False`` in error handlers, where
    a peer may be gone.

    After the barrier, Gloo's worker threads still release the finished collectives, and
    releasing a tensor that Python let go of takes the GIL. If the interpreter is already
    shutting down by then, CPython 3.11 ends the thread inside a C++ destructor and the
    process aborts ("terminate called without an active exception", SIGABRT, a few runs in
    a hundred under load; open upstream as pytorch/pytorch#190489). So the caller waits a
    moment with the GIL free: the threads finish while the interpreter is whole. (herd's
    workers also wait at exit, ``torchherd.exit_guard``; this covers plain torchrun.)
    """
    if _leave_group(barrier):
        let_threads_finish()


def _leave_group(barrier: bool) -> bool:
    """Barrier (optionally) and destroy the process group; False when there was none."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    return True


def teardown_and_exit(code: int = 0) -> NoReturn:
    """``teardown()``, then leave the process at once, without the interpreter's cleanup.

    For jobs that are done once they return (herd's demo and measuring jobs). A process group
    held by a DDP model is really freed only with the model, at interpreter exit, and torch
    2.13's ``~ProcessGroupGloo`` can then deadlock with its own runloop thread over the GIL
    (seen about once in 25 runs under load); a rank that destroys the group while a peer
    still finishes its last collective can abort (SIGABRT). The barrier in ``teardown()``
    prevents the second, leaving without running those destructors the first.
    """
    _leave_group(barrier=True)  # no interpreter shutdown follows, so nothing to wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def current_context() -> Context:
    """This process's context without creating a process group (adopts one that exists)."""
    if dist.is_available() and dist.is_initialized():
        return setup()
    local_rank = _env_int("LOCAL_RANK", 0)
    return Context(
        rank=_env_int("RANK", 0),
        local_rank=local_rank,
        world_size=_env_int("WORLD_SIZE", 1),
        device=_pick_device(local_rank),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        node_rank=_env_int("GROUP_RANK", 0),
    )
