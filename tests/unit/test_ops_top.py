"""herd top: GPU readings (recorded nvidia-smi output), step rates, the table."""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.agent import node_load as sample
from torchherd.agent.control import write_agent_record
from torchherd.cli.top import render
from torchherd.ops.top import NodeLoad

# nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used,memory.total,temperature.gpu,
# power.draw --format=csv,noheader,nounits, on a 2-GPU node (one without a power reading)
NVIDIA_SMI = """\
0, NVIDIA H100 80GB HBM3, 97, 71234, 81559, 66, 612.45
1, NVIDIA H100 80GB HBM3, 35, 1024, 81559, 41, [N/A]
"""


def test_parse_nvidia_smi() -> None:
    gpus = sample.parse_nvidia_smi(NVIDIA_SMI)
    assert gpus[0] == {
        "index": 0.0,
        "name": "NVIDIA H100 80GB HBM3",
        "util": 97.0,
        "mem_used": 71234 << 20,
        "mem_total": 81559 << 20,
        "temp": 66.0,
        "power": 612.45,
    }
    assert gpus[1]["power"] is None
    load = NodeLoad("gpu1", gpus=tuple(gpus))
    assert load.gpu_summary() == {
        "count": 2,
        "util": 66.0,
        "mem_used": 72258 << 20,
        "mem_total": 163118 << 20,
        "temp": 66.0,
        "power": 612.45,
    }
    assert sample.parse_nvidia_smi("garbage\n") == []


def test_cpu_and_memory_readings_are_sane() -> None:
    busy, total = sample.cpu_times()
    assert 0 <= busy <= total
    memory = sample.memory()
    assert 0 < memory["used"] < memory["total"]


def test_step_rate_from_local_rank_zeros_log(tmp_path: Path) -> None:
    node_dir = tmp_path / "nodes" / "job1" / "n1"
    log = node_dir / "attempt-0" / "torchrun" / "job1_x" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text("hello\nstep 10 loss 1.0\n")
    write_agent_record(str(node_dir), "job1", "n1", detached=True)  # this process: "running"
    (tmp_path / "nodes" / "job2" / "n2").mkdir(parents=True)  # another node's: not listed
    write_agent_record(str(tmp_path / "nodes" / "job2" / "n2"), "job2", "n2", detached=True)
    before = time.monotonic()
    sampler = sample.Sampler(str(tmp_path), "n1")
    time.sleep(0.2)
    with log.open("a") as handle:
        handle.write("Step: 30 | loss 0.5\n")
    first = sampler.sample()
    after = time.monotonic()
    [job] = first["jobs"]
    assert (job["job_id"], job["step"]) == ("job1", 30)
    # 20 steps over the sampler's own interval, which lies within [before, after] and holds
    # the 0.2 s sleep: bounds that hold however slow the machine is.
    assert 20 / (after - before) <= job["step_rate"] <= 20 / 0.2
    again = sampler.sample()["jobs"][0]
    assert again["step_rate"] == job["step_rate"]  # unchanged step: the last rate, and its age
    assert again["step_age"] >= 0
    assert 0 <= first["cpu_percent"] <= 100 and first["hostname"]
    json.dumps(first)  # what the verb prints


def test_render_has_a_row_per_node_and_says_why_a_node_is_missing() -> None:
    loads = [
        NodeLoad(
            "gpu1",
            cpu_percent=12.0,
            mem_used=8 << 30,
            mem_total=64 << 30,
            gpus=tuple(sample.parse_nvidia_smi(NVIDIA_SMI)),
            jobs=({"job_id": "j1", "step": 1200, "step_rate": 3.25, "step_age": 0.5},),
        ),
        NodeLoad("cpu1", cpu_percent=50.0, mem_used=1 << 30, mem_total=4 << 30),
        NodeLoad("gone", error="gone: connection timed out"),
    ]
    buffer = io.StringIO()
    Console(file=buffer, width=200).print(render(loads))
    lines = buffer.getvalue().splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["gpu1", "cpu1", "gone"]
    assert "2× NVIDIA H100 80GB HBM3" in lines[1] and "step 1200, 3.25/s" in lines[1]
    assert lines[2].split()[1:4] == ["50", "1.0/4.0", "none"]
    assert "connection timed out" in lines[3]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
def test_top_verb_answers_json(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "torchherd.agent", "top"],
        input=json.dumps({"window": 0.1, "herd_home": str(tmp_path)}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["jobs"] == [] and data["memory"]["total"] > 0


def test_an_80_column_terminal_shows_one_line_per_node() -> None:
    # The README's sample: two H100 nodes running a job, one CPU node.
    gpus = tuple(
        {
            "name": "NVIDIA H100 80GB HBM3",
            "util": 97.0,
            "mem_used": 70 << 30,
            "mem_total": 80 << 30,
            "temp": 71.0,
            "power": 675.0,
        }
        for _ in range(8)
    )
    job = {"job_id": "1122-023330-7016", "step": 1800, "step_rate": 3.21, "step_age": 0.4}
    loads = [
        NodeLoad(
            host, cpu_percent=23.0, mem_used=61 << 30, mem_total=503 << 30, gpus=gpus, jobs=(job,)
        )
        for host in ("gpu1", "gpu2")
    ] + [NodeLoad("cpu1", cpu_percent=4.0, mem_used=2 << 30, mem_total=31 << 30)]
    buffer = io.StringIO()
    Console(file=buffer, width=80).print(render(loads, 80))
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 4, "\n".join(lines)  # a header and one line per node, none wrapped
    assert all(len(line) <= 80 for line in lines)
    assert "8× H100" in lines[1]
    assert " 7016 " in lines[1] and "step 1800, 3.21/s" in lines[1]  # the id's last part, whole
    wide = io.StringIO()
    Console(file=wide, width=200).print(render(loads, 200))
    assert "1122-023330-7016" in wide.getvalue() and "TEMP C" in wide.getvalue()


def test_recent_step_times_come_from_the_ranks_own_beats_on_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beats written by torchherd.progress as a Trainer's rank writes them, in the newest
    attempt's progress directory: the sampler keeps one value per sample in which a rank beat
    again, the node's slowest rank's work (step less wait)."""
    from torchherd import progress
    from torchherd.agent import attempt

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(attempt, "_progress_root", None)
    node_dir = tmp_path / "nodes" / "job1" / "n1"
    node_dir.mkdir(parents=True)
    write_agent_record(str(node_dir), "job1", "n1", detached=True)
    old = Path(attempt.progress_root()) / "job1" / "n1" / "attempt-0"
    beats = Path(attempt.progress_root()) / "job1" / "n1" / "attempt-1"
    old.mkdir(parents=True)
    beats.mkdir(parents=True)
    (old / "rank-0").write_text("5 1.0 - 9.0 10.0 0.0\n")  # an earlier attempt's: not read
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(beats))

    def beat(rank: int, step: int, wait: float, cycle: float) -> None:
        monkeypatch.setenv("RANK", str(rank))
        progress.beat(step, wait=wait, cycle=cycle, now=True)

    beat(0, 10, 0.05, 0.2)
    beat(1, 10, 0.01, 0.2)
    sampler = sample.Sampler(str(tmp_path), "n1")  # its first reading
    first = sampler.sample()["jobs"][0]
    assert first["step_times"] == [0.19] and first["step_time_measure"] == "work"
    assert sampler.sample()["jobs"][0]["step_times"] == [0.19]  # no beat since: no new value
    beat(1, 11, 0.02, 0.3)
    assert sampler.sample()["jobs"][0]["step_times"] == [0.19, 0.28]


def test_the_step_time_column_shows_a_sparkline_per_node_on_one_scale() -> None:
    def node(host: str, times: list[float] | None) -> NodeLoad:
        job: dict[str, object] = {"job_id": "1122-023330-7016", "step": 90, "step_rate": 5.0}
        if times is not None:
            job["step_times"] = times
        return NodeLoad(host, cpu_percent=50.0, mem_used=1 << 30, mem_total=4 << 30, jobs=(job,))

    fast = [0.15, 0.15, 0.16, 0.15]
    loads = [node("n1", fast), node("n2", [0.15, 0.15, 0.18, 0.18]), node("n3", None)]
    buffer = io.StringIO()
    Console(file=buffer, width=200).print(render(loads, 200))
    lines = buffer.getvalue().splitlines()
    assert "STEP TIME" in lines[0]
    assert lines[1].split()[-2:] == ["▁▁▃▁", "150ms"]
    assert lines[2].split()[-2:] == ["▁▁██", "180ms"]  # the slow one: tall from its third step
    assert lines[3].split()[-1] == "-"  # its job times no steps
    compact = io.StringIO()
    Console(file=compact, width=80).print(render(loads, 80))
    small = compact.getvalue().splitlines()
    assert all(len(line) <= 80 for line in small) and len(small) == 4, "\n".join(small)
    assert small[2].split()[-1] == "▁▁██"
    plain = io.StringIO()
    Console(file=plain, width=200).print(render([node("n1", None)], 200))
    assert "STEP TIME" not in plain.getvalue()  # no job times its steps: no column


def test_replica_groups_show_each_groups_step_from_its_first_node_or_how_long_it_is_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchherd.ops.top import NodeLoad, replica_groups
    from torchherd.records import JobRecord

    monkeypatch.setenv("HERD_HOME", str(tmp_path))
    down_at = time.time() - 12
    JobRecord(
        id="j1", state="running", started=time.time() - 60, source="ssh", nodes=[],
        world_size=4, command=[], rdzv_endpoint=None, log_dir=str(tmp_path),
        groups=[
            {"group": 0, "host": "n1,n2", "nodes": ["n1", "n2"], "exit_code": None,
             "outages": []},
            {"group": 1, "host": "n3,n4", "nodes": ["n3", "n4"], "exit_code": None,
             "outages": [{"down_at": down_at, "steps_before": 40, "healed_s": None}]},
        ],
    ).save()  # fmt: skip
    loads = [
        NodeLoad("n1", jobs=({"job_id": "j1-g0", "step": 57}, {"job_id": "j1-lighthouse"})),
        NodeLoad("n2", jobs=({"job_id": "j1-g0", "step": None},)),
    ]
    (line,) = replica_groups(loads)
    said = re.fullmatch(r"job j1: replica groups: g0 n1,n2 step 57; g1 n3,n4 down (\d+) s "
                        r"\(since step 40\)", line)  # fmt: skip
    assert said and 11 <= int(said.group(1)) <= 14, line
