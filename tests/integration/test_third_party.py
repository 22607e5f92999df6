"""Third-party training scripts run unchanged under `herd launch` on the testbed's GPU-less
nodes and become one distributed job: Accelerate's own test script, a Hugging Face Trainer
script and a Lightning script. The first two only treat torchrun's environment as multi-CPU
when ACCELERATE_USE_CPU is set, which herd's plan sets on nodes without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.herd_cli import herd
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"

pytest.importorskip("accelerate", reason="needs the hf extra: pip install 'torchherd[hf]'")


def test_accelerates_own_test_script_runs_on_two_nodes(testbed: Testbed, tmp_path: Path) -> None:
    # Its checks assume two processes, as in Accelerate's own CI: 2 nodes x 1 worker.
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", "node2"],
        workdir=str(tmp_path),
        env={"HERD_HOME": str(tmp_path / "home")},
    )
    run = herd(
        ["launch", "-c", str(path), "-m", "accelerate.test_utils.scripts.test_script"],
        tmp_path / "home",
        tmp_path,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "DistributedType.MULTI_CPU" in run.stdout, run.stdout[-4000:]
    assert "Num processes: 2" in run.stdout
    assert "DistributedType.NO" not in run.stdout and "Num processes: 1\n" not in run.stdout


def test_hf_trainer_script_trains_one_model_on_three_nodes(
    testbed: Testbed, tmp_path: Path
) -> None:
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", "node2", "node3"],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(tmp_path / "home"), "HF_OUT": str(tmp_path / "hf-out")},
    )
    run = herd(
        ["launch", "-c", str(path), "hf_trainer_world.py"], tmp_path / "home", SCRIPTS, timeout=400
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    found = {
        int(m.group(1)): (m.group(2), m.group(3))
        for m in re.finditer(r"RESULT rank=(\d+) world=(\d+) weights=(\S+)", run.stdout)
    }
    assert sorted(found) == [0, 1, 2], run.stdout[-4000:]
    assert {world for world, _ in found.values()} == {"3"}, found
    # Each rank trained on its own data: equal weights only if gradients were averaged.
    assert len({weights for _, weights in found.values()}) == 1, found


def test_lightning_script_trains_one_model_on_two_nodes(testbed: Testbed, tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="needs lightning: pip install -e '.[dev]'")
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", "node2"],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(tmp_path / "home")},
    )
    run = herd(
        ["launch", "-c", str(path), "lightning_world.py"], tmp_path / "home", SCRIPTS, timeout=400
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    found = {
        int(m.group(1)): (m.group(2), m.group(3))
        for m in re.finditer(r"RESULT rank=(\d+) world=(\d+) weights=(\S+)", run.stdout)
    }
    assert sorted(found) == [0, 1], run.stdout[-4000:]
    assert {world for world, _ in found.values()} == {"2"}, found
    # Each rank trained on its own data: equal weights only if gradients were averaged.
    assert len({weights for _, weights in found.values()}) == 1, found
