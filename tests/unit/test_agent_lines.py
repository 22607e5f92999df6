"""Worker lines on their way out of a node agent: batched to the launcher in order, filtered
on large jobs (rank 0 and every rank's stderr sent, the rest kept on the node and announced as
progress), and read back from the node's files by the logs verb. Real agents, real pipes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from torchherd.agent import control
from torchherd.agent.attempt import progress_root

# What torchrun's tee prints: every worker line prefixed with [herd RANK LOCAL_RANK].
TORCHRUN_LIKE = (
    "import sys, time\n"
    "for i in range(50):\n"
    "    print(f'[herd 0 0] zero {i}', flush=True)\n"
    "    print(f'[herd 1 1] one {i}', flush=True)\n"
    "print('[herd 1 1] one says a problem', file=sys.stderr, flush=True)\n"
    "time.sleep(1.5)\n"
)


def run_agent(tmp_path: Path, **request: object) -> list[dict[str, object]]:
    """One attempt of a real agent over pipes; its events, up to the exit."""
    job = f"lines-{uuid.uuid4().hex[:6]}"
    full = {
        "job_id": job,
        "node": "n1",
        "grace": 1,
        "env": {"HERD_HOME": str(tmp_path / "home")},
        "argv": [sys.executable, "-c", TORCHRUN_LIKE],
        **request,
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "torchherd.agent", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdin is not None and agent.stdout is not None
    agent.stdin.write(json.dumps(full) + "\n")
    agent.stdin.flush()
    events = []
    for line in agent.stdout:
        events.append(json.loads(line))
        if events[-1]["e"] == "exit":
            break
    agent.stdin.close()
    agent.wait(timeout=30)
    # The ranks' progress files lived on node-local storage; nothing of the job is left there.
    assert not os.path.exists(os.path.join(progress_root(), job)), os.listdir(progress_root())
    return events


def sent_lines(events: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    found = []
    for event in events:
        if event["e"] == "lines":
            found += [(r, s, t) for r, _, s, t in event["b"]]  # type: ignore[union-attr]
        elif event["e"] == "line":
            found.append((event["r"], event["s"], event["t"]))
    return found


def test_lines_come_in_batches_in_their_order(tmp_path: Path) -> None:
    events = run_agent(tmp_path)
    batches = [e for e in events if e["e"] == "lines"]
    lines = sent_lines(events)
    expected = [(r, "o", f"{name} {i}") for i in range(50) for r, name in ((0, "zero"), (1, "one"))]
    assert [x for x in lines if x[1] == "o"] == expected
    assert len(batches) < len(lines) / 5, "lines were not batched"
    # Nothing comes after the exit event: the last batch was sent before it.
    assert events[-1]["e"] == "exit"


def test_a_large_job_sends_rank_zero_and_stderr_and_keeps_the_rest(tmp_path: Path) -> None:
    events = run_agent(tmp_path, send={"ranks": [0], "stderr": True})
    lines = sent_lines(events)
    assert {r for r, s, _ in lines if s == "o"} == {0}
    assert (1, "e", "one says a problem") in lines
    spoke = {r for e in events if e["e"] == "spoke" for r in e["r"]}  # type: ignore[union-attr]
    assert spoke == {1}  # its lines stayed here, but the launcher knows it made progress
    job = str(events[-1]["node_dir"]).split(os.sep)[-2]
    attempt_dir = tmp_path / "home" / "nodes" / job / "n1" / "attempt-0"
    assert json.loads((attempt_dir / "ranks.json").read_text()) == {"0": 0, "1": 1}


# A rank that prints and beats for a few seconds, its lines kept on the node.
PRINTS_AND_BEATS = (
    "import os, time\n"
    "os.environ['RANK'] = '1'\n"
    "from torchherd import progress\n"
    "for step in range(35):\n"
    "    print(f'[herd 1 1] step {step}', flush=True)\n"
    "    progress.beat(step, now=True)\n"
    "    time.sleep(0.1)\n"
)


def test_a_rank_that_beats_is_told_as_spoken_once(tmp_path: Path) -> None:
    """Kept lines of a rank whose beats go out in the same reports are progress the beats
    already show: the launcher hears they exist once (the rank joined), not every report."""
    events = run_agent(
        tmp_path,
        argv=[sys.executable, "-c", PRINTS_AND_BEATS],
        send={"ranks": [0], "stderr": True},
        report_every=1.0,
    )
    beats = [e for e in events if e["e"] == "beats"]
    spoke = [e["r"] for e in events if e["e"] == "spoke"]
    assert len(beats) >= 2, events  # several reports went out while it beat
    assert spoke == [[1]], spoke


def test_the_logs_verb_reads_a_ranks_kept_lines(tmp_path: Path) -> None:
    node_dir = tmp_path / "nodes" / "job" / "n1"
    for attempt, words in ((0, ["first"]), (1, ["second", "third"])):
        attempt_dir = node_dir / f"attempt-{attempt}"
        files = attempt_dir / "torchrun" / "run_x" / "attempt_0" / "1"
        files.mkdir(parents=True)
        (files / "stdout.log").write_text("".join(f"{w}\n" for w in words))
        (files / "stderr.log").write_text(f"warning {attempt}\n")
        (attempt_dir / "ranks.json").write_text(json.dumps({"3": 1}))
    out = io.BytesIO()
    code = control.logs(
        {"herd_home": str(tmp_path), "job_id": "job", "node": "n1", "kept": True, "rank": 3},
        out,
        watch_stdin=False,
    )
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 0
    assert [(e["r"], e["s"], e["t"]) for e in events] == [
        (3, "o", "first"),
        (3, "e", "warning 0"),
        (3, "o", "second"),
        (3, "o", "third"),
        (3, "e", "warning 1"),
    ]
    assert (
        control.logs(
            {"herd_home": str(tmp_path), "job_id": "job", "node": "n1", "kept": True, "rank": 5},
            io.BytesIO(),
            watch_stdin=False,
        )
        == 1
    )  # a rank that never ran here


def test_herd_logs_of_a_large_jobs_rank_asks_the_nodes_for_its_kept_lines(tmp_path: Path) -> None:
    """An attached large job keeps only stderr in the launcher's files: `herd logs --rank R`
    reads the rest from the node that ran R (the local transport runs a real agent)."""
    from torchherd.ops.joblogs import show_logs
    from torchherd.records import JobRecord

    node_dir = tmp_path / "nodes" / "job" / "localhost"
    files = node_dir / "attempt-0" / "torchrun" / "run_x" / "attempt_0" / "0"
    files.mkdir(parents=True)
    (files / "stdout.log").write_text("step 1\nstep 2\n")
    (files / "stderr.log").write_text("")
    (node_dir / "attempt-0" / "ranks.json").write_text(json.dumps({"7": 0}))
    record = JobRecord(
        id="job",
        state="done",
        started=0.0,
        source="ssh",
        nodes=[{"host": "localhost"}],
        world_size=8,
        command=["train.py"],
        rdzv_endpoint=None,
        log_dir=str(tmp_path / "logs"),
        cluster={"nodes": [{"host": "localhost"}], "python": sys.executable, "transport": "local"},
        node_dirs={"localhost": str(node_dir)},
        lines_on_nodes=True,
    )
    shown = io.StringIO()
    show_logs(record, 7, follow=False, stream=shown)
    assert shown.getvalue() == "step 1\nstep 2\n"  # as rank-R.log would hold them
    try:
        show_logs(record, 6, follow=False, stream=io.StringIO())
    except Exception as error:  # noqa: BLE001 - the kind and words are what is checked
        assert "no node kept lines from rank 6" in str(error), error
    else:
        raise AssertionError("a rank without lines was not refused")


def test_the_wrappers_notice_of_a_bad_worker_end_is_an_event_of_its_own(tmp_path: Path) -> None:
    """The wrapper's notice (agent/worker_exits.py), written to the pipe the agent gave it,
    reaches the launcher as a "worker-exit" event before the attempt's exit, once, even after
    a rank's unfinished line (a progress bar's) on the wrapper's stderr."""
    wrapper_like = (
        "import os, sys\n"
        "print('[herd 0 0]  50%|#####     | 5/10', end='', file=sys.stderr, flush=True)\n"
        "pipe = os.fdopen(int(os.environ['HERD_NOTICE_FD']), 'w')\n"
        'pipe.write(\'{"pid": 4321, "code": 3}\\n\'); pipe.flush()\n'
        'pipe.write(\'{"pid": 4322, "code": 3}\\n\'); pipe.flush()\n'  # told once all the same
        "print('[herd 0 0] the worker said something', flush=True)\n"
        "sys.exit(1)\n"
    )
    events = run_agent(tmp_path, argv=[sys.executable, "-c", wrapper_like])
    kinds = [e["e"] for e in events]
    assert kinds.count("worker-exit") == 1 and kinds.index("worker-exit") < kinds.index("exit")
    ended = next(e for e in events if e["e"] == "worker-exit")
    assert (ended["host"], ended["pid"], ended["code"]) == ("n1", 4321, 3), ended
    said = json.dumps([e for e in events if e["e"] in ("line", "lines")])
    assert "the worker said something" in said and "5/10" in said
