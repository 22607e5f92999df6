"""What the batch script set up, carried explicitly to every node's agent.

A batch script loads modules, activates a virtual environment and exports NCCL settings; the
processes a scheduler (or ssh) starts on the other nodes see none of that unless it is sent.
This is the allow-list that travels: the search paths, the environment roots, and families of
variables that tune the job. Never a secret (names that look like one are left out: those belong
in env_file, which travels over stdin), and never a per-node value such as CUDA_VISIBLE_DEVICES,
which the scheduler sets on each node itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..spec import SECRET_NAME

CARRIED_NAMES = (
    "PATH",
    "LD_LIBRARY_PATH",
    "LIBRARY_PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "MODULEPATH",
    "LOADEDMODULES",
    "CUDA_HOME",
    "CUDA_PATH",
    "OMP_NUM_THREADS",
    "HF_HOME",
)
"""Variables carried by name."""
CARRIED_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "PYTORCH_", "UCX_", "FI_", "HERD_")
"""Variable families carried whole (tuning for NCCL, Gloo, CUDA, torch, the fabric)."""
NEVER_CARRIED = frozenset(
    {"CUDA_VISIBLE_DEVICES", "HERD_HOME", "HERD_PROGRESS_DIR", "HERD_ATTEMPT"}
)
"""Per-node or per-process values: each node has its own."""


def carried_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed variables of ``environ`` (the launcher's), secrets left out."""
    carried = {}
    for name, value in environ.items():
        if name in NEVER_CARRIED or SECRET_NAME.search(name):
            continue
        if name in CARRIED_NAMES or name.startswith(CARRIED_PREFIXES):
            carried[name] = value
    return carried
