"""Known failure signatures -> a cause and a fix, in words (table-driven, unit-tested).

``explain(text)`` looks at a failure's message and the last lines of its stderr and returns the
first matching entry of SIGNATURES. Order matters: specific signatures come before the general
ones they would also match (an NCCL error that says "Connection reset" is an NCCL error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    kind: str
    cause: str
    fix: str


@dataclass(frozen=True)
class Signature:
    kind: str
    pattern: re.Pattern[str]
    cause: str
    fix: str


def _sig(kind: str, pattern: str, cause: str, fix: str) -> Signature:
    return Signature(kind, re.compile(pattern, re.IGNORECASE), cause, fix)


SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "cuda-oom",
        r"CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED",
        "the GPU ran out of memory",
        "use a smaller batch per GPU (with gradient accumulation to keep the global batch), "
        "mixed precision, activation checkpointing or FSDP",
    ),
    _sig(
        "device-ordinal",
        r"invalid device ordinal|CUDA error: invalid device",
        "a worker asked for a GPU the node does not have (more workers than GPUs)",
        "set nproc for that node to its GPU count or fewer (herd doctor shows the counts), "
        "and check CUDA_VISIBLE_DEVICES there",
    ),
    _sig(
        "cuda-kernel",
        r"device-side assert triggered|an illegal memory access was encountered|"
        r"CUDA error: (misaligned address|unspecified launch failure|an illegal instruction)",
        "a CUDA kernel failed on the GPU (an index out of range in a gather or an embedding, "
        "or a kernel that read or wrote outside its memory)",
        "run the failing rank again with CUDA_LAUNCH_BLOCKING=1 (in [cluster] env) so the "
        "error points at the right line; check indices and labels against the sizes they "
        "index (a label >= num_classes, a token id >= vocab size)",
    ),
    _sig(
        "abort-at-teardown",
        r"terminate called without an active exception",
        "a worker aborted (SIGABRT) at its end: a thread of the process group still held "
        "tensors as the interpreter shut down, or a peer still used the group as it was destroyed",
        "end the script with torchherd.train.teardown() (a barrier, then the group destroyed "
        "while its threads may finish), or dist.barrier() before dist.destroy_process_group()",
    ),
    _sig(
        "nccl",
        r"NCCL (WARN|error)|nccl\w*Error|ncclSystemError|ncclInternalError|ncclRemoteError|"
        r"NCCL communicator was aborted|ProcessGroupNCCL.*(timeout|Watchdog)",
        "NCCL failed: a peer died, the network between GPUs broke, or NCCL chose the wrong NIC",
        "look for the first failing rank's own error above; run `herd doctor` (NICs, ports) "
        "and retry with NCCL_DEBUG=WARN in [cluster] env to see NCCL's reason",
    ),
    _sig(
        "rendezvous-timeout",
        r"RendezvousTimeoutError|rendezvous.{0,40}timed? ?out",
        "not every node joined the rendezvous in time",
        "the nodes that never joined cannot reach the rendezvous host or did not start: "
        "run `herd doctor` on them",
    ),
    _sig(
        "address-in-use",
        r"Address already in use|EADDRINUSE|errno: 98",
        "a port the job needs was already taken on a node",
        "set [cluster] rdzv_port to a free port or leave it out (herd picks one); end the "
        "old job that holds it (`herd ps`, `herd stop`)",
    ),
    _sig(
        "version-mismatch",
        r"version mismatch|undefined symbol|compiled (against|with) .*version|"
        r"size mismatch for|different versions",
        "nodes run different versions of torch (or of its libraries)",
        "install the same torch/CUDA/NCCL everywhere; `herd doctor` shows a table of versions",
    ),
    _sig(
        "peer-connection",
        r"Connection refused|Connection reset by peer|Connection closed by peer|Broken pipe|"
        r"connectFullMesh|remote process exited|DistNetworkError",
        "a connection to another rank was refused or reset: that rank died first, or a "
        "firewall blocks the ports between nodes",
        "look at the failure of the peer it names; if none failed, open the ephemeral TCP "
        "ports between the nodes (`herd doctor` checks them)",
    ),
)


def explain(text: str) -> Cause | None:
    """The first known cause in ``text`` (a failure message and its last stderr lines)."""
    for signature in SIGNATURES:
        if signature.pattern.search(text):
            return Cause(signature.kind, signature.cause, signature.fix)
    return None
