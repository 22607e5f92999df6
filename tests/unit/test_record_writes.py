"""job.json has one writer at a time, and a file replaced from two threads at once is never
torn: write_private's temporary file is its own per thread. A record written reads back the
same. Real files, real threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from torchherd.files import write_private
from torchherd.records import JobRecord, attempt_entry, load_record


def test_threads_replacing_one_file_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "job.json"
    errors: list[BaseException] = []
    texts = {n: json.dumps({"writer": n, "pad": "x" * 20_000}) for n in range(6)}

    def write(n: int) -> None:
        try:
            for _ in range(150):
                write_private(target, texts[n])
        except BaseException as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert target.read_text() in texts.values()
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]  # no temporary left behind


def test_a_record_reads_back_as_it_was_written_a_field_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERD_HOME", str(tmp_path))
    nodes = [{"host": f"gpu{n}", "nproc": 8, "rates": [1.5, 2.25]} for n in range(40)]
    record = JobRecord(
        id="1129-120000-abcd",
        state="running",
        started=1795900000.25,
        source="herd.toml",
        nodes=nodes,
        world_size=320,
        command=["train.py", "--lr", "3e-4", 'a "quoted" word', "ünïcode"],
        rdzv_endpoint="10.0.0.1:29400",
        log_dir=str(tmp_path / "logs"),
        first_failure={"host": "gpu3", "rank": 25, "exitcode": -9, "signal": "SIGKILL"},
        attempts=[attempt_entry(0, nodes, 320, "10.0.0.1:29400")],
    )
    record.save()
    assert load_record(record.id) == record
    lines = (tmp_path / "jobs" / record.id / "job.json").read_text().splitlines()
    # One top-level field a line: `grep '"state"' job.json` finds the state.
    assert '  "state": "running",' in lines
    assert len(lines) == len(JobRecord.__dataclass_fields__) + 2
