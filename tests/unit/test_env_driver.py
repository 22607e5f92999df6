"""The doctor's driver check: can each node's NVIDIA driver run the CUDA build of the lock's
torch? No GPU can run here, so the driver versions come from a FAKE nvidia-smi (named so) that
prints the probe's query in nvidia-smi's own format; the probe's own code runs it and reads it,
and the doctor's checks judge what it read."""

from __future__ import annotations

from pathlib import Path

from torchherd.agent import probe_full
from torchherd.facts import NodeFacts
from torchherd.preflight import Findings, Status, run_checks
from torchherd.preflight.environment import cuda_of, driver_runs
from torchherd.spec import ClusterSpec, NodeSpec


def fake_nvidia_smi(folder: Path, driver: str) -> Path:
    """A FAKE nvidia-smi: one A100 with ``driver``, answering the probe's --query-gpu line
    (index, uuid, name, memory.total, memory.used, utilization.gpu, driver_version) as
    nvidia-smi prints it with --format=csv,noheader,nounits."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n# FAKE nvidia-smi for tests: no GPU can run here.\n"
        'echo "0, GPU-5b7f1d2e-3c4a-4b5c-8d6e-7f8091a2b3c4, NVIDIA A100-SXM4-80GB, 81920, 4, '
        f'0, {driver}"\n'
    )
    script.chmod(0o755)
    return script


def node_facts(host: str, smi: Path) -> NodeFacts:
    """The facts the full probe reports for a node whose nvidia-smi is ``smi``: the probe's
    own calls start it and read its answer."""
    gpus, driver = probe_full._gpus(
        probe_full._finish(
            probe_full._start(
                [
                    str(smi),
                    "--query-gpu=index,uuid,name,memory.total,memory.used,"
                    "utilization.gpu,driver_version",
                    "--format=csv,noheader,nounits",
                ]
            ),
            15,
        )
    )
    return NodeFacts.from_probe(
        host,
        {"python_version": "3.11.2", "gpu_count": len(gpus), "gpus": gpus, "driver": driver},
    )


def driver_results(tmp_path: Path, torch: str | None) -> dict[str, object]:
    nodes = (NodeSpec(host="gpu1"), NodeSpec(host="gpu2"))
    cluster = ClusterSpec(nodes=nodes, source="test", env_lock="uv.lock")
    facts = {
        "gpu1": node_facts("gpu1", fake_nvidia_smi(tmp_path / "new", "550.54.15")),
        "gpu2": node_facts("gpu2", fake_nvidia_smi(tmp_path / "old", "470.82.01")),
    }
    findings = Findings(cluster=cluster, facts=facts, env_torch=torch)
    return {r.host: r for r in run_checks(findings) if r.check == "driver"}


def test_a_driver_too_old_for_the_locks_cuda_build_is_named_with_what_it_needs(
    tmp_path: Path,
) -> None:
    results = driver_results(tmp_path, "2.13.0+cu128")
    assert results["gpu1"].status is Status.PASS  # type: ignore[attr-defined]
    old = results["gpu2"]
    assert old.status is Status.FAIL  # type: ignore[attr-defined]
    assert old.summary == (  # type: ignore[attr-defined]
        "driver 470.82.01 cannot run the lock's torch 2.13.0+cu128 (CUDA 12.8): it needs "
        "525.60 or newer"
    )
    assert "update the NVIDIA driver on gpu2 to 525.60 or newer" in old.remedy  # type: ignore[attr-defined]


def test_an_older_cuda_build_runs_on_both_and_a_cpu_build_is_not_judged(tmp_path: Path) -> None:
    results = driver_results(tmp_path, "2.7.1+cu118")
    assert {r.status for r in results.values()} == {Status.PASS}  # type: ignore[attr-defined]
    assert driver_results(tmp_path, "2.13.0+cpu") == {}
    assert driver_results(tmp_path, None) == {}


def test_versions_and_build_labels() -> None:
    assert cuda_of("2.13.0+cu128") == (12, 8)
    assert cuda_of("2.9.0+cu130") == (13, 0)
    assert cuda_of("2.13.0+cpu") is None and cuda_of("2.13.0") is None
    assert driver_runs("580.65.06", (13, 0)) and not driver_runs("575.51.03", (13, 0))
    assert driver_runs("525.60.13", (12, 8)) and not driver_runs("525.53", (12, 0))
