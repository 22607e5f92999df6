"""Fixtures for tests/gpu: herd's NCCL/CUDA paths, run where NVIDIA GPUs are.

Every test here is marked ``gpu`` and skipped, with the reason, on a machine without a GPU (the
one skip CI allows: tests/integration's conftest turns only its own skips into failures).
Where nvidia-smi lists GPUs the tests run, even if torch cannot use them: then they fail and
say why, rather than skip. `scripts/gpu-check` runs them and puts each in its table.

The pytest process itself never initialises CUDA: GPU work runs in the jobs the tests launch
and in subprocesses, so no test sees the test runner holding memory on a GPU (the doctor would
count it as another process there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.gpu.launching import HerdRun, JobVerdict, launch
from bench.gpu.machine import TorchFeatures, no_gpu, read_torch
from bench.gpu.smi import SmiReport, read_smi

_HERE = Path(__file__).resolve().parent


@functools.cache
def machine() -> tuple[SmiReport, TorchFeatures]:
    """nvidia-smi's GPUs and torch's features here (torch asked in a subprocess)."""
    return read_smi(), read_torch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _HERE in Path(item.path).resolve().parents]
    if not ours:
        return
    why = no_gpu(*machine())
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def torch_here() -> TorchFeatures:
    return machine()[1]


@pytest.fixture(scope="session")
def smi() -> SmiReport:
    return machine()[0]


@pytest.fixture(scope="session")
def gpus(torch_here: TorchFeatures) -> int:
    """GPUs torch can use here (a test that needs some asserts it, so a broken setup fails)."""
    return torch_here.device_count


@pytest.fixture
def two_gpus(gpus: int) -> int:
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs, {gpus} here")
    return gpus


LaunchScript = Callable[..., tuple[HerdRun, JobVerdict | None]]


@pytest.fixture
def launch_script(tmp_path: Path) -> LaunchScript:
    """``launch_script(source, *launch_args, env=..., timeout=...)``: write ``source`` as
    job.py in a fresh folder and `herd launch` it there with a private HERD_HOME."""

    def run(
        source: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
    ) -> tuple[HerdRun, JobVerdict | None]:
        (tmp_path / "job.py").write_text(source)
        return launch(
            [*args, "job.py"], home=tmp_path / "home", cwd=tmp_path, timeout=timeout, env=env
        )

    return run
