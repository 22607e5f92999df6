"""What this machine offers the GPU check: torch's version and features, and whether there is a
GPU to check at all.

torch is asked in a short subprocess (``FEATURES_SNIPPET``), so the check's own process never
initialises CUDA: it would hold memory on GPU 0 for the whole run, and the doctor would see it
as another process on the GPU. Features are detected, never assumed from the version number:
``torch.compile`` needs Triton for GPUs, DCP's ``async_save`` and its buffer-reusing stagers
came in over several releases, FSDP2's ``fully_shard`` became public in 2.6.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from .smi import SmiReport

OLDEST_TORCH = (2, 4)
"""herd supports torch 2.4 and newer; the check runs on the same range."""
NEWEST_TESTED = (2, 13)
"""The newest torch the check was written against (newer ones run, with a note)."""

FEATURES_SNIPPET = r"""
import inspect, json, sys
out = {"ok": False}
try:
    import torch
except BaseException as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
out.update(ok=True, version=torch.__version__, cuda=torch.version.cuda)
try:
    out["cuda_available"] = torch.cuda.is_available()
    out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(out["device_count"])]
    out["memory"] = [
        torch.cuda.get_device_properties(i).total_memory for i in range(out["device_count"])
    ]
except Exception as exc:
    out["cuda_error"] = f"{type(exc).__name__}: {exc}"
try:
    version = torch.cuda.nccl.version() if torch.version.cuda else None
    out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
except Exception:
    out["nccl"] = None
out["compile"] = callable(getattr(torch, "compile", None))
try:
    from torch.utils._triton import has_triton
    out["triton"] = bool(has_triton())
except Exception:
    out["triton"] = False
try:
    from torch.distributed.checkpoint import state_dict_saver
    out["dcp_async_save"] = callable(getattr(state_dict_saver, "async_save", None))
except Exception:
    out["dcp_async_save"] = False
try:
    from torch.distributed.checkpoint import staging
    out["dcp_default_stager"] = all(
        hasattr(staging, name) for name in ("DefaultStager", "StagingOptions")
    )
except Exception:
    out["dcp_default_stager"] = False
try:
    from torch.distributed.checkpoint import FileSystemWriter
    parameters = inspect.signature(FileSystemWriter).parameters
    out["dcp_cached_writer"] = "cache_staged_state_dict" in parameters
except Exception:
    out["dcp_cached_writer"] = False
try:
    from torch.distributed.fsdp import fully_shard
    out["fsdp2"] = True
except Exception:
    out["fsdp2"] = False
print(json.dumps(out))
"""


@dataclass(frozen=True)
class TorchFeatures:
    """torch as this machine's python has it."""

    ok: bool
    error: str | None = None
    version: str | None = None
    cuda: str | None = None
    """The CUDA torch was built for (None: a CPU build)."""
    cuda_available: bool = False
    device_count: int = 0
    devices: tuple[str, ...] = ()
    memory: tuple[int, ...] = ()
    """Each device's total memory in bytes, as torch sees it."""
    nccl: str | None = None
    compile: bool = False
    triton: bool = False
    """torch.compile on a GPU needs Triton (pip wheels of torch for CUDA bring it)."""
    dcp_async_save: bool = False
    dcp_default_stager: bool = False
    """DCP's DefaultStager/StagingOptions: pinned, reused buffers for async_save."""
    dcp_cached_writer: bool = False
    """The older way to reuse DCP's buffers: FileSystemWriter(cache_staged_state_dict=True)."""
    fsdp2: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TorchFeatures:
        known = set(cls.__dataclass_fields__) - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        values["devices"] = tuple(values.get("devices") or ())
        values["memory"] = tuple(values.get("memory") or ())
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def compile_on_gpu(self) -> str | None:
        """Why torch.compile cannot run on the GPU here (None: it can)."""
        if not self.compile:
            return f"torch {self.version} has no torch.compile"
        if not self.triton:
            return "torch.compile needs Triton on a GPU, and it is not installed"
        return None

    @property
    def dcp_stager(self) -> str | None:
        """How DCP's async_save reuses its host buffers in this torch, best first."""
        if not self.dcp_async_save:
            return None
        if self.dcp_default_stager:
            return "DefaultStager"
        if self.dcp_cached_writer:
            return "FileSystemWriter(cache_staged_state_dict=True)"
        return "none"


def read_torch(python: str = sys.executable, timeout: float = 180.0) -> TorchFeatures:
    """torch's features as ``python`` imports it (a subprocess; CUDA stays out of ours)."""
    try:
        done = subprocess.run(
            [python, "-c", FEATURES_SNIPPET], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return TorchFeatures(ok=False, error=f"importing torch took over {timeout:g} s")
    lines = done.stdout.strip().splitlines()
    try:
        return TorchFeatures.from_dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return TorchFeatures(ok=False, error=f"importing torch crashed: {last[0]}")


def version_tuple(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def no_gpu(smi: SmiReport, torch: TorchFeatures) -> str | None:
    """The one line a machine without a GPU gets (None: there is a GPU to check).

    A GPU that nvidia-smi lists counts even when torch cannot use it: that is a broken setup
    for the check to report, not a machine without a GPU.
    """
    if smi.gpus or (torch.ok and torch.cuda_available and torch.device_count > 0):
        return None
    smi_says = smi.error or "nvidia-smi lists no GPU"
    if not torch.ok:
        torch_says = f"torch does not import ({torch.error})"
    elif torch.cuda is None:
        torch_says = f"torch {torch.version} is a CPU build"
    else:
        torch_says = f"torch {torch.version} sees no CUDA device"
    return f"no NVIDIA GPU on this machine ({smi_says}; {torch_says})"


def cannot_check(smi: SmiReport, torch: TorchFeatures) -> str | None:
    """Why a machine with GPUs cannot run the check at all (None: it can): a problem to fix,
    reported as a failure with what to do."""
    if not torch.ok:
        return f"torch does not import: {torch.error}; install torch >= 2.4 for this python"
    found = version_tuple(torch.version)
    if found is None or found < OLDEST_TORCH:
        return f"torch {torch.version} is older than 2.4, which herd needs; upgrade torch"
    if not torch.cuda_available or torch.device_count == 0:
        why = "a CPU build" if torch.cuda is None else torch.extra.get("cuda_error", "no device")
        count = len(smi.gpus)
        return (
            f"nvidia-smi lists {count} GPU(s) but torch {torch.version} cannot use them ({why}); "
            "install the torch build for this driver (https://pytorch.org/get-started/locally/)"
        )
    return None


def torch_note(torch: TorchFeatures) -> str | None:
    """A line for a torch newer than the check was written against."""
    found = version_tuple(torch.version)
    if found is not None and found > NEWEST_TESTED:
        newest = ".".join(map(str, NEWEST_TESTED))
        return f"torch {torch.version} is newer than {newest}, the newest this check knows"
    return None
