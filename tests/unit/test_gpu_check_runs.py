"""The GPU check's parts run for real on this CPU machine wherever the GPU is not essential:
the command itself (one line without a GPU; a failure where nvidia-smi lists GPUs that torch
cannot use), pytest's JUnit report read back, verdicts from real job records, the GPT pair (the
Trainer through `herd launch` and the hand-written loop) on Gloo, the snapshot and copy workers
on CPU tensors. The one fake: an nvidia-smi script (no GPU can run here) printing two H100s in
nvidia-smi's formats.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_check import SMI_HEADER, SMI_QUERY

from bench.gpu import allreduce, gpt, machine, snapshots
from bench.gpu.launching import REPO, launch, python_module
from bench.gpu.smi import SmiReport, read_smi
from bench.gpu.suite import parse_junit, run_suite

TORCH = machine.read_torch()
NO_GPU = machine.no_gpu(read_smi(), TORCH)
needs_no_gpu = pytest.mark.skipif(
    NO_GPU is None, reason="this machine has a GPU: the check would run in full"
)


def fake_nvidia_smi(folder: Path) -> Path:
    """A FAKE nvidia-smi (named so): the query and the header of two H100s, as nvidia-smi
    prints them."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n# FAKE nvidia-smi for tests: no GPU can run here.\n"
        f"case \"$1\" in\n  --query-gpu=*) cat <<'EOF'\n{SMI_QUERY}EOF\n  ;;\n"
        f"  *) cat <<'EOF'\n{SMI_HEADER}EOF\n  ;;\nesac\n"
    )
    script.chmod(0o755)
    return folder


def gpu_check(*args: str, path_prefix: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check"), *args],
        env={**env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_no_gpu
def test_without_a_gpu_the_check_says_so_in_one_line() -> None:
    done = gpu_check()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"gpu-check: {NO_GPU}: nothing to check"]


@pytest.mark.skipif(TORCH.cuda is not None, reason="needs a CPU-only torch")
def test_gpus_torch_cannot_use_fail_the_check(tmp_path: Path) -> None:
    done = gpu_check("-o", str(tmp_path / "out"), path_prefix=fake_nvidia_smi(tmp_path / "bin"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 x NVIDIA H100 80GB HBM3, driver 550.54.15, driver CUDA 12.4" in done.stdout
    assert done.stderr.startswith("gpu-check: 2 x NVIDIA H100"), done.stderr
    assert "torch can use the GPUs" in done.stdout and "FAILED" in done.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["exit_code"] == 1
    assert [row["verdict"] for row in report["rows"]] == ["FAILED"]
    assert "cannot use them (a CPU build)" in report["rows"][0]["detail"]
    assert len(report["machine"]["nvidia_smi"]["gpus"]) == 2


def test_the_fake_nvidia_smi_reads_like_the_real_one(tmp_path: Path) -> None:
    folder = fake_nvidia_smi(tmp_path)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{folder}{os.pathsep}{path}"
    try:
        report = read_smi()
    finally:
        os.environ["PATH"] = path
    assert isinstance(report, SmiReport) and report.error is None
    assert [g.index for g in report.gpus] == [0, 1] and report.cuda == "12.4"


JUNIT_TESTS = """
import pytest

def test_ok():
    pass

def test_broken():
    assert 1 == 2, "one is not two"

def test_needs_two():
    pytest.skip("needs 2 GPUs, 1 here")

@pytest.mark.xfail(strict=True, reason="no signature yet")
def test_gap():
    assert False

@pytest.mark.xfail(strict=True, reason="fixed meanwhile")
def test_fixed():
    pass
"""


def test_junit_from_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(JUNIT_TESTS)
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junit-xml={junit}"]
        + ["-o", "junit_family=xunit1", str(tmp_path / "test_sample.py")],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    rows = {row.name: row for row in parse_junit(junit.read_text())}
    assert {name: row.verdict for name, row in rows.items()} == {
        "test_sample::test_ok": "passed",
        "test_sample::test_broken": "FAILED",
        "test_sample::test_needs_two": "not run",
        "test_sample::test_gap": "not run",
        "test_sample::test_fixed": "FAILED",
    }
    assert "one is not two" in rows["test_sample::test_broken"].detail
    assert rows["test_sample::test_needs_two"].detail == "needs 2 GPUs, 1 here"
    assert rows["test_sample::test_gap"].detail == "known gap (xfail): no signature yet"


@needs_no_gpu
def test_suite_part_reports_every_gpu_test_as_not_run_here(tmp_path: Path) -> None:
    rows = run_suite(tmp_path)
    assert len(rows) >= 10
    assert {row.verdict for row in rows} == {"not run"}
    assert {row.detail for row in rows} == {NO_GPU}
    assert "test_hang_cuda::test_rank_spinning_in_a_kernel_is_hung_with_stacks" in {
        row.name for row in rows
    }


FAILS = "print('step 1', flush=True)\nraise SystemExit(3)\n"
HANGS = """
import time
from torchherd.progress import beat
for step in range(1, 4):
    beat(step)
    print(f"step {step}", flush=True)
    time.sleep(0.3)
time.sleep(600)
"""


def test_verdicts_from_real_job_records(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text(FAILS)
    (tmp_path / "hangs.py").write_text(HANGS)
    run, job = launch(["--nproc", "1", "fails.py"], home=tmp_path / "a", cwd=tmp_path)
    assert job is not None, run.tail()
    assert (job.state, job.exit_code, job.outcome) == ("failed", 1, "failed")
    assert job.failure["rank"] == 0 and job.failure["exitcode"] == 3 and not job.succeeded
    assert job.describe().startswith("failed (exit 1); localhost rank 0")
    run, job = launch(
        ["--nproc", "1", "--hang-timeout", "5", "--grace", "2", "hangs.py"],
        home=tmp_path / "b",
        cwd=tmp_path,
        timeout=180,
    )
    assert job is not None, run.tail()
    assert job.outcome == "hung" and job.state == "failed", run.tail()
    assert job.stacks_dir and list(Path(job.stacks_dir).glob("*rank-0.txt")), job


def test_gpt_pair_through_herd_launch_on_cpu(tmp_path: Path) -> None:
    """The Trainer (examples/gpt.py) and the hand-written loop with the check's own command
    lines, a tiny model on Gloo: the rows come out, MFU not run (no GPU peak)."""
    settings = gpt.GptSettings(
        steps=8,
        warmup=4,
        log_every=2,
        batch_size=2,
        size={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64},
    )
    rows = gpt.run_setting(tmp_path, "eager", False, settings)
    assert [row.name for row in rows] == [
        "examples/gpt.py (Trainer), eager",
        "hand-written loop, eager",
        "Trainer overhead, eager",
        "MFU in metrics.jsonl, eager",
    ], rows
    assert all(row.value and row.value > 0 for row in rows[:3])
    assert rows[2].verdict in ("met", "NOT MET")
    assert rows[3].verdict == "not run" and "no peak FLOP/s known for cpu" in rows[3].detail


def test_snapshot_worker_on_cpu_tensors(tmp_path: Path) -> None:
    args = ["--dir", str(tmp_path / "scratch"), "--gigabytes", "0.01", "--device", "cpu"]
    done, answer = python_module(
        "bench.gpu.snapshot_worker", [*args, "--rounds", "1"], snapshots.MARKER, timeout=240
    )
    assert answer is not None, done.tail()
    assert answer["round_trip"] is True and answer["tensors"] == 1
    assert answer["dcp_reuse"] == ("DefaultStager (reused)" if TORCH.dcp_default_stager else None)
    rows = snapshots.snapshot_rows(answer)
    assert [row.verdict in ("met", "NOT MET") for row in rows[1:3]] == [True, True]
    assert list((tmp_path / "scratch").iterdir()) == []  # it cleans up after itself


def test_dcp_reference_falls_back_when_its_stager_fails_on_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11 (seen on an H200) closes the caller's DefaultStager after a save, and the
    next save fails inside DCP. Here the real stager is closed after each save, as there: the
    check names that failure and measures DCP with the next way that works instead of giving up
    (on a CPU-only torch the cached writer fails too: it pins memory)."""
    import torch

    from bench.gpu import snapshot_worker as worker

    real = worker._dcp_savers

    def stager_closed_after_each_save(scratch: Path, gpu: bool) -> list[worker.Saver]:
        savers = real(scratch, gpu)
        label, save, close = savers[0]

        def save_then_close(state: object, path: str) -> object:
            pending = save(state, path)
            close()
            return pending

        return [(label, save_then_close, close), *savers[1:]]

    monkeypatch.setattr(worker, "_dcp_savers", stager_closed_after_each_save)
    answer = worker.measure_dcp({"w": torch.ones(4096)}, tmp_path, rounds=1)
    expected = "none (no buffer reuse)" if TORCH.cuda is None else "FileSystemWriter("
    assert answer["dcp_reuse"].startswith(expected), answer
    failure = answer["dcp_fallbacks"][0]
    assert failure.startswith("DefaultStager (reused): KeyError"), failure
    assert len(answer["dcp_stall_s"]) == 1
    assert not any(path.name.startswith("dcp-") for path in tmp_path.iterdir())
    answer |= {"bytes": 16384, "tensors": 1, "sync_s": [1.0], "stall_s": [0.05]}
    answer |= {"round_trip": True}
    answer |= {"sync_median_s": 1.0, "stall_median_s": 0.05}
    answer["dcp_stall_median_s"] = answer["dcp_stall_s"][0]
    row = snapshots.snapshot_rows(answer)[2]
    assert "failed first: DefaultStager (reused): KeyError" in row.detail, row


def test_copy_worker_on_cpu() -> None:
    args = ["--device", "cpu", "--megabytes", "8", "--rounds", "3"]
    done, answer = python_module("bench.gpu.copy_worker", args, allreduce.COPY_MARKER, timeout=120)
    assert answer is not None, done.tail()
    rows = allreduce.copy_rows(answer)
    assert all(row.value and row.value > 0 for row in rows)


def test_torch_features_of_this_torch() -> None:
    version = machine.version_tuple(TORCH.version)
    assert TORCH.ok and version is not None and version >= (2, 4)
    assert TORCH.compile and TORCH.dcp_async_save
    assert TORCH.fsdp2 == (version >= (2, 6))
