"""The GPU check's CPU-testable logic (scripts/gpu-check, bench/gpu/): nvidia-smi parsing and its
comparison with the probe's facts, the no-GPU decision, the MFU and tokens/s arithmetic, the
ratio and target rows, the one-GPU fallback of the all-reduce part, the snapshot pre-check,
the report's JSON and table.

The nvidia-smi texts below are samples in nvidia-smi's output format (two H100s), written here
because no GPU is at hand; the doctor facts are shaped as `herd doctor --json` prints them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from bench.gpu import allreduce, gpt, machine, snapshots
from bench.gpu.report import Report, Target, failed, measured, not_run, passed, render
from bench.gpu.smi import SmiReport, compare_with_probe, parse_cuda_version, parse_query, visible

SMI_QUERY = """\
0, GPU-6f3c2a1e-7b5d-4c3e-9a8b-1c2d3e4f5a6b, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 00000000:19:00.0
1, GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 00000000:3B:00.0
"""  # noqa: E501 - nvidia-smi's lines as they come
SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""
H100_BYTES = 85_031_813_120  # what torch's total_memory says for an 81,559 MiB H100


def smi_report() -> SmiReport:
    return SmiReport(gpus=tuple(parse_query(SMI_QUERY)), cuda=parse_cuda_version(SMI_HEADER))


def probe_facts(**changes: object) -> dict[str, object]:
    """One host's facts from `herd doctor --json` on that machine, as the probe gives them."""
    facts: dict[str, object] = {
        "gpu_count": 2,
        "driver": "550.54.15",
        "gpus": [
            {"index": i, "uuid": g.uuid, "name": g.name, "memory_total_mib": 81559}
            for i, g in enumerate(parse_query(SMI_QUERY))
        ],
        "torch": {
            "ok": True,
            "cuda": "12.4",
            "nccl": "2.21.5",
            "device_count": 2,
            "devices": [
                {"name": "NVIDIA H100 80GB HBM3", "memory": H100_BYTES, "capability": "9.0"}
            ]
            * 2,
        },
    }
    facts.update(changes)
    return facts


# ------------------------------------------------------------------------------ nvidia-smi


def test_parse_query_reads_each_gpu() -> None:
    gpus = parse_query(SMI_QUERY + "garbage line\n[N/A], x, y, z, w, v\n")
    assert [(g.index, g.name, g.memory_mib, g.driver) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 81559, "550.54.15"),
        (1, "NVIDIA H100 80GB HBM3", 81559, "550.54.15"),
    ]
    assert gpus[1].bus_id == "00000000:3B:00.0"
    na = parse_query("0, GPU-1, NVIDIA GH200 480GB, [N/A], 560.35.03, 00000009:01:00.0\n")
    assert na[0].memory_mib is None and na[0].name == "NVIDIA GH200 480GB"


def test_parse_cuda_version() -> None:
    assert parse_cuda_version(SMI_HEADER) == "12.4"
    assert parse_cuda_version("NVIDIA-SMI has failed because it couldn't communicate") is None


def test_visible_follows_cuda_visible_devices() -> None:
    gpus = smi_report().gpus
    assert [g.index for g in visible(gpus, None)] == [0, 1]
    assert [g.index for g in visible(gpus, "1")] == [1]
    assert [g.index for g in visible(gpus, "1,0")] == [1, 0]
    assert [g.index for g in visible(gpus, "GPU-0a1b")] == [1]  # a UUID prefix
    assert [g.index for g in visible(gpus, "0,7,1")] == [0]  # CUDA stops at a bad entry
    assert visible(gpus, "") == []


def test_probe_and_nvidia_smi_agree() -> None:
    comparison = compare_with_probe(probe_facts(), smi_report())
    assert comparison.differ == []
    assert {line.split(":")[0] for line in comparison.agree} == {
        "GPUs listed",
        "GPUs visible",
        "GPU names",
        "GPU memory",
        "driver",
        "CUDA",
    }


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"gpu_count": 1}, "GPUs visible: device files (gpu_count) 1, nvidia-smi 2"),
        ({"driver": "535.104.05"}, "driver: probe 535.104.05, nvidia-smi 550.54.15"),
        ({"gpus": []}, "GPUs listed: probe 0, nvidia-smi 2"),
    ],
)
def test_probe_and_nvidia_smi_differ(changes: dict[str, object], what: str) -> None:
    assert compare_with_probe(probe_facts(**changes), smi_report()).differ == [what]


def test_torch_facts_that_differ_are_named() -> None:
    torch = dict(probe_facts()["torch"])  # type: ignore[call-overload]
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "memory": H100_BYTES, "capability": "8.0"}
    torch.update(devices=[torch["devices"][0], a100], device_count=2, cuda="13.0")
    differ = compare_with_probe(probe_facts(torch=torch), smi_report()).differ
    assert [line.split(":")[0] for line in differ] == ["GPU names", "CUDA"]
    assert "a newer CUDA major than the driver has" in differ[1]
    torch.update(devices=[{**a100, "name": "NVIDIA H100 80GB HBM3", "memory": 40 << 30}] * 2)
    torch["cuda"] = "12.6"  # a newer minor works with the driver's 12.4
    differ = compare_with_probe(probe_facts(torch=torch), smi_report()).differ
    assert [line.split(":")[0] for line in differ] == ["GPU memory"]


def test_visible_devices_narrow_what_torch_must_see() -> None:
    torch = dict(probe_facts()["torch"])  # type: ignore[call-overload]
    torch.update(devices=torch["devices"][:1], device_count=1)
    facts = probe_facts(torch=torch, gpu_count=1)
    assert compare_with_probe(facts, smi_report(), "1").differ == []
    assert compare_with_probe(facts, smi_report()).differ != []


# ------------------------------------------------------------------------------ machine


def features(**values: object) -> machine.TorchFeatures:
    base: dict[str, object] = {
        "ok": True,
        "version": "2.13.0+cu126",
        "cuda": "12.6",
        "cuda_available": True,
        "device_count": 1,
        "devices": ["NVIDIA H100 80GB HBM3"],
        "compile": True,
        "triton": True,
        "dcp_async_save": True,
        "dcp_default_stager": True,
    }
    return machine.TorchFeatures.from_dict({**base, **values})


def test_no_gpu_is_one_line_and_only_without_any_gpu() -> None:
    cpu = features(version="2.13.0+cpu", cuda=None, cuda_available=False, device_count=0)
    missing = SmiReport(error="nvidia-smi not found")
    assert machine.no_gpu(missing, cpu) == (
        "no NVIDIA GPU on this machine (nvidia-smi not found; torch 2.13.0+cpu is a CPU build)"
    )
    broken = machine.TorchFeatures(ok=False, error="ImportError: libcudart.so.12")
    assert "torch does not import (ImportError" in (machine.no_gpu(missing, broken) or "")
    # nvidia-smi lists GPUs: there is a GPU, even if torch cannot use it (a failure to report).
    assert machine.no_gpu(smi_report(), cpu) is None
    # No nvidia-smi in a container, but torch sees the GPU.
    assert machine.no_gpu(missing, features()) is None


def test_cannot_check_says_what_to_fix() -> None:
    assert machine.cannot_check(smi_report(), features()) is None
    cpu = features(version="2.13.0+cpu", cuda=None, cuda_available=False, device_count=0)
    why = machine.cannot_check(smi_report(), cpu) or ""
    assert "nvidia-smi lists 2 GPU(s) but torch 2.13.0+cpu cannot use them (a CPU build)" in why
    assert "pytorch.org" in why
    old = machine.cannot_check(smi_report(), features(version="2.3.1+cu121")) or ""
    assert old.startswith("torch 2.3.1+cu121 is older than 2.4")
    assert machine.torch_note(features(version="2.14.0")) is not None
    assert machine.torch_note(features(version="2.4.1")) is None


def test_features_name_what_cannot_run() -> None:
    assert features().compile_on_gpu is None
    assert "Triton" in (features(triton=False).compile_on_gpu or "")
    assert features().dcp_stager == "DefaultStager"
    older = features(dcp_default_stager=False, dcp_cached_writer=True)
    assert older.dcp_stager == "FileSystemWriter(cache_staged_state_dict=True)"
    assert features(dcp_default_stager=False).dcp_stager == "none"
    assert features(dcp_async_save=False).dcp_stager is None
    assert machine.version_tuple("2.6.0a0+git1234") == (2, 6)


# ------------------------------------------------------------------------------ gpt arithmetic


def test_steady_rate_is_total_work_over_total_time() -> None:
    # Three windows of 10 steps; the first (compilation) is left out: 2 windows at 100 and
    # 300 tokens/s take 0.1 + 1/30 of the time per token: 2 / (1/100 + 1/300) = 150.
    records: list[dict[str, float]] = [
        {"step": 10, "tokens_per_s": 5.0},
        {"step": 15},
        {"step": 20, "tokens_per_s": 100.0},
        {"step": 30, "tokens_per_s": 300.0},
    ]
    assert gpt.steady(records, 10, "tokens_per_s") == pytest.approx(150.0)
    assert gpt.steady(records, 30, "tokens_per_s") is None
    assert gpt.steady([{"step": 20, "mfu": 0.0}], 0, "mfu") is None


def test_mfu_arithmetic() -> None:
    # 100k tokens/s of 1,024-token samples at 1 TFLOP each, on 2 GPUs of 989 TFLOP/s peak.
    value = gpt.mfu(100_000, 1e12, 1024, 989e12, 2)
    assert value == pytest.approx(100_000 / 1024 * 1e12 / (2 * 989e12))


HAND = {
    "world_size": 1,
    "tokens_per_s": 204_000.0,
    "flops_per_sample": 6.0e11,
    "tokens_per_sample": 1024,
    "device": "NVIDIA H100 80GB HBM3",
    "peak_flops": 989e12,
}


def trainer_records(tokens: float, mfu: float | None) -> list[dict[str, object]]:
    records: list[dict[str, object]] = [{"step": s, "loss": 1.0} for s in range(1, 81)]
    for record in records:
        if record["step"] in (10, 20, 30):
            record["tokens_per_s"] = tokens / 3  # warm-up windows: left out
        elif int(record["step"]) % 10 == 0:  # type: ignore[call-overload]
            record["tokens_per_s"] = tokens
            if mfu is not None:
                record["mfu"] = mfu
    return records


def test_setting_rows_ratio_target_and_mfu_agreement() -> None:
    settings = gpt.GptSettings()
    share = gpt.mfu(200_000, 6.0e11, 1024, 989e12, 1)
    rows = gpt.setting_rows("compiled", trainer_records(200_000, share), HAND, settings)
    by_name = {row.name: row for row in rows}
    trainer = by_name["examples/gpt.py (Trainer), compiled"]
    assert trainer.value == pytest.approx(share) and trainer.target == gpt.MFU_TARGET
    assert trainer.met is (share >= 0.40)
    overhead = by_name["Trainer overhead, compiled"]
    assert overhead.value == pytest.approx(1.02) and overhead.verdict == "met"
    assert by_name["MFU in metrics.jsonl, compiled"].verdict == "passed"
    slower = gpt.setting_rows("eager", trainer_records(150_000, None), HAND, settings)
    by_name = {row.name: row for row in slower}
    assert by_name["Trainer overhead, eager"].verdict == "NOT MET"
    assert by_name["examples/gpt.py (Trainer), eager"].target is None  # the target is compiled's
    assert by_name["MFU in metrics.jsonl, eager"].verdict == "FAILED"  # peak known, no MFU


def test_mfu_target_only_on_an_h100_and_not_run_without_a_peak() -> None:
    a100 = {**HAND, "device": "NVIDIA A100-SXM4-80GB", "peak_flops": 312e12}
    share = gpt.mfu(200_000, 6.0e11, 1024, 312e12, 1)
    rows = gpt.setting_rows("compiled", trainer_records(200_000, share), a100, gpt.GptSettings())
    assert rows[0].target is None and rows[0].verdict == "measured"
    l4 = {**HAND, "device": "NVIDIA L4", "peak_flops": None}
    rows = gpt.setting_rows("compiled", trainer_records(200_000, None), l4, gpt.GptSettings())
    assert rows[0].value == pytest.approx(200_000)  # tokens/s when MFU is unknown
    assert rows[-1].verdict == "not run" and "no peak FLOP/s known for NVIDIA L4" in rows[-1].detail
    assert gpt.mfu_agreement("x", trainer_records(1, 0.3), 30, None, "L4").verdict == "FAILED"
    off = gpt.mfu_agreement("x", trainer_records(1, 0.30), 30, 0.20, "H100")
    assert off.verdict == "FAILED" and "30.00%" in off.detail


def test_gpt_arguments_are_gpt2_small_in_bf16(tmp_path: Path) -> None:
    argv = gpt.trainer_argv(gpt.GptSettings(), True, tmp_path)
    text = " ".join(argv)
    for part in ("--n-layer 12", "--n-head 12", "--n-embd 768", "--block-size 1024"):
        assert part in text
    assert "--precision bf16" in text and "--compile true" in text and "--dropout 0" in text
    hand = gpt.hand_argv(gpt.GptSettings(), False)
    assert hand[0] == "bench/gpu/gpt_hand.py" and "--compile false" in " ".join(hand)
    assert hand[1:-2] == gpt.common_args(gpt.GptSettings(), False)  # the same model and steps


# ------------------------------------------------------------------------------ parts' rows


def test_allreduce_one_gpu_falls_back_to_copy_bandwidth() -> None:
    assert allreduce.mode(1) == "copy" and allreduce.mode(2) == "between"
    result = {
        "world_size": 1,
        "backend": "nccl",
        "correct": True,
        "rows": [{"size_bytes": 1 << 20, "busbw_gbytes": 0.0, "algbw_gbytes": 90.0}],
    }
    rows = allreduce.bench_rows(result, 1)
    assert [(r.verdict, r.name) for r in rows] == [("passed", "herd bench allreduce, 1 rank(s)")]
    copy = allreduce.copy_rows(
        {"bytes": 1 << 30, "device_to_device_gbytes": 1500.0, "host_to_device_gbytes": 50.0}
    )
    assert [r.value for r in copy] == [1500.0, 50.0]
    assert all(r.verdict == "measured" for r in copy)


def test_allreduce_between_gpus_and_what_fails() -> None:
    good = {
        "world_size": 8,
        "backend": "nccl",
        "correct": True,
        "rows": [
            {"size_bytes": 1 << 20, "busbw_gbytes": 40.0, "algbw_gbytes": 23.0},
            {"size_bytes": 256 << 20, "busbw_gbytes": 410.0, "algbw_gbytes": 234.0},
        ],
    }
    rows = allreduce.bench_rows(good, 8)
    assert rows[0].verdict == "passed" and rows[1].value == 410.0
    assert "at 256 MiB" in rows[1].detail
    gloo = allreduce.bench_rows({**good, "backend": "gloo"}, 8)
    assert gloo[0].verdict == "FAILED" and "the GPUs were not used" in gloo[0].detail
    wrong = allreduce.bench_rows({**good, "world_size": 4, "correct": False}, 8)
    assert "not one worker per GPU" in wrong[0].detail and "wrong sums" in wrong[0].detail


def test_snapshot_precheck() -> None:
    gb = snapshots.GB
    assert snapshots.precheck(4 * gb, 100 * gb, 80 * gb, 120 * gb) is None
    assert "only 10.0 GB free" in (snapshots.precheck(4 * gb, 10 * gb, 80 * gb, 120 * gb) or "")
    assert "GPU 0 has 4 GB" in (snapshots.precheck(4 * gb, 100 * gb, 4 * gb, 120 * gb) or "")
    assert "host memory" in (snapshots.precheck(4 * gb, 100 * gb, 80 * gb, 10 * gb) or "")
    assert snapshots.precheck(4 * gb, 100 * gb, None, None) is None


def test_snapshot_rows() -> None:
    answer = {
        "bytes": 4.3e9,
        "tensors": 64,
        "sync_s": [8.0, 8.2],
        "stall_s": [0.5, 0.6],
        "sync_median_s": 8.1,
        "stall_median_s": 0.55,
        "dcp_stall_s": [0.9],
        "dcp_stall_median_s": 0.9,
        "dcp_reuse": "DefaultStager (pinned, reused)",
        "round_trip": True,
    }
    rows = snapshots.snapshot_rows(answer)
    assert [r.verdict for r in rows] == ["measured", "met", "met", "passed"]
    assert rows[1].value == pytest.approx(0.55 / 8.1)
    slow = snapshots.snapshot_rows({**answer, "stall_median_s": 1.0, "round_trip": False})
    assert [r.verdict for r in slow] == ["measured", "NOT MET", "NOT MET", "FAILED"]
    no_dcp = snapshots.snapshot_rows(
        {**answer, "dcp_stall_median_s": None, "dcp_error": "RuntimeError: x"}
    )
    assert no_dcp[2].verdict == "not run" and "RuntimeError: x" in no_dcp[2].detail


# ------------------------------------------------------------------------------ report


def test_row_verdicts_never_call_a_missing_check_passed() -> None:
    target = Target("<=", 1.02)
    assert measured("p", "x", 1.01, "", target).verdict == "met"
    assert measured("p", "x", 1.03, "", target).verdict == "NOT MET"
    assert measured("p", "x", 1.03, "").verdict == "measured"
    assert not_run("p", "x", "one GPU").verdict == "not run"
    assert not_run("p", "x", "one GPU").met is None
    assert Target(">=", 0.4).met(0.4) and not Target("<", 1.0).met(1.0)
    assert str(Target("<=", 0.1)) == "<= 0.1"


def sample_report() -> Report:
    report = Report(machine={"host": "gpu1"}, started="20250101-000000", seconds=412.0)
    report.add(
        [
            passed("tests/gpu", "test_nccl::test_nccl_allreduce_one_worker_per_gpu", "9.1 s"),
            not_run("allreduce", "NCCL all-reduce between GPUs", "one GPU here"),
            measured("gpt", "Trainer overhead, eager", 1.031, "ratio = 1.031", Target("<=", 1.02)),
            failed("snapshot", "snapshot worker", "exit 1: CUDA error"),
        ]
    )
    return report


def test_report_json_schema_and_exit_code(tmp_path: Path) -> None:
    report = sample_report()
    report.write(tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema"] == "torchherd-gpu-check/1"
    assert set(data) == {"schema", "started", "seconds", "machine", "rows", "counts", "notes"} | {
        "exit_code"
    }
    assert data["counts"] == {
        "passed": 1,
        "failed": 1,
        "not_run": 1,
        "met": 0,
        "not_met": 1,
        "measured": 0,
    }
    row = data["rows"][2]
    assert row["target"] == "<= 1.02" and row["met"] is False and row["verdict"] == "NOT MET"
    assert set(row) == {"part", "name", "status", "detail", "value", "target", "data"} | {
        "met",
        "verdict",
    }
    assert data["exit_code"] == 1
    report.rows.pop()  # the failed row: a target not met alone is no failure
    assert report.exit_code == 0


def test_table_shows_every_row_and_the_counts() -> None:
    out = io.StringIO()
    render(sample_report(), Console(file=out, width=160, color_system=None))
    text = out.getvalue()
    assert text.splitlines()[0].split() == ["part", "check", "result", "target", "verdict"]
    assert "not run" in text and "one GPU here" in text and "NOT MET" in text
    assert "<= 1.02" in text and "FAILED" in text
    assert "1 passed, 1 failed, 1 not run; targets: 0 met, 1 not met; 412 s" in text
