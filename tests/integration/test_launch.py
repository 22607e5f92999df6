"""`herd launch` on the testbed: real sshd, real torchrun, real Gloo across network namespaces."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.herd_cli import herd
from tests.integration.procs import ProcessWatch, assert_all_stopped, wait_for
from tests.testbed import Testbed, TestNode

SCRIPTS = Path(__file__).parent / "scripts"


def cluster(
    testbed: Testbed, tmp_path: Path, nodes: list[str | dict[str, object]], **keys: object
) -> Path:
    return testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=nodes,
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(tmp_path / "home")},
        **keys,
    )


def results(stdout: str) -> dict[int, dict[str, str]]:
    found = {}
    for match in re.finditer(r"^(\S+?):(\d+)\s*\| RESULT (.*)$", stdout, re.M):
        fields = dict(item.split("=", 1) for item in match.group(3).split())
        fields["prefix_host"] = match.group(1)
        found[int(match.group(2))] = fields
    return found


# What ran on each node before the test began (an earlier test's node cut off, say, can leave
# an sshd session that outlives the partition): not this test's to judge.
_EARLIER: dict[str, set[int]] = {}


@pytest.fixture(autouse=True)
def _earlier_node_processes(request: pytest.FixtureRequest) -> None:
    _EARLIER.clear()
    if "testbed" in request.fixturenames:
        testbed = request.getfixturevalue("testbed")
        _EARLIER.update({n.name: set(testbed.node_processes(n)) for n in testbed.nodes})


def _new_on(testbed: Testbed, node: TestNode) -> list[int]:
    return [pid for pid in testbed.node_processes(node) if pid not in _EARLIER.get(node.name, ())]


def assert_nothing_left(
    testbed: Testbed, home: Path, settle: float = 3.0, job_grace: float = 0.0
) -> None:
    """Right after herd exits: no process of the job anywhere, and nothing else left running on
    any node (agents, torchrun, workers, sshd sessions), allowing ``settle`` seconds for sshd
    sessions to see their client gone. ``job_grace``: seconds the job's processes may take to
    go (where no herd waited for them: a launcher that was killed)."""
    job_ids = [p.name for p in (home / "jobs").iterdir()]
    deadline = time.monotonic() + job_grace
    tagged = [pid for job in job_ids for pid in testbed.processes_with_env("HERD_JOB_ID", job)]
    while tagged and time.monotonic() < deadline:
        time.sleep(0.2)
        tagged = [pid for job in job_ids for pid in testbed.processes_with_env("HERD_JOB_ID", job)]
    deadline = time.monotonic() + settle
    left = {n.name: _new_on(testbed, n) for n in testbed.nodes}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {n.name: _new_on(testbed, n) for n in testbed.nodes}
    assert not tagged, f"processes of the job still running when herd exited: {tagged}"
    assert not any(left.values()), f"processes left on the nodes: {left}"


def start_sleeping_job(
    path: Path,
    home: Path,
    ranks: int,
    herd_args: tuple[str, ...] = (),
    script_args: tuple[str, ...] = (),
    **popen: object,
) -> subprocess.Popen[str]:
    """Launch allreduce.py --sleep 300 and return once all ``ranks`` ranks are asleep."""
    env = dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "torchherd", "launch", "-c", str(path), *herd_args]
    process = subprocess.Popen(
        [*command, "allreduce.py", "--sleep", "300", *script_args],
        cwd=SCRIPTS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,  # type: ignore[call-overload]
    )
    sleeping: set[str] = set()
    assert process.stdout is not None
    # Reading lines has no timeout of its own: a job that hangs silently is killed after
    # 180 s, which ends the output and the loop.
    watchdog = threading.Timer(180, process.kill)
    watchdog.start()
    try:
        for line in process.stdout:
            if "SLEEPING" in line:
                sleeping.add(line.split("rank=")[1].split()[0])
            if len(sleeping) == ranks:
                return process
    finally:
        watchdog.cancel()
    process.kill()
    raise AssertionError(f"the job never reached its sleep (ranks asleep: {sorted(sleeping)})")


def test_two_nodes_two_workers_allreduce(testbed: Testbed, tmp_path: Path) -> None:
    path = cluster(
        testbed, tmp_path, [{"host": "node1", "nproc": 2}, {"host": "node2", "nproc": 2}]
    )
    run = herd(["launch", "-c", str(path), "allreduce.py"], tmp_path / "home", SCRIPTS)
    assert run.returncode == 0, run.stdout + run.stderr
    found = results(run.stdout)
    assert sorted(found) == [0, 1, 2, 3]
    for fields in found.values():
        assert fields["sum"] == "10" and fields["world"] == "4"  # 1+2+3+4 on every rank
        assert fields["host"] == fields["prefix_host"]  # the prefix names the node it ran on
        assert fields["master"] == testbed.node("node1").addr  # never 127.0.1.1 from /etc/hosts
    assert {found[r]["host"] for r in found} == {"node1", "node2"}
    log_dir = tmp_path / "home" / "jobs"
    (job,) = list(log_dir.iterdir())
    for rank in range(4):
        assert "RESULT" in (job / f"rank-{rank}.log").read_text()
    assert "succeeded" in run.stdout
    assert_nothing_left(testbed, tmp_path / "home")


def test_different_nproc_per_node(testbed: Testbed, tmp_path: Path) -> None:
    path = cluster(
        testbed, tmp_path, [{"host": "node1", "nproc": 2}, {"host": "node3", "nproc": 1}]
    )
    run = herd(["launch", "-c", str(path), "allreduce.py"], tmp_path / "home", SCRIPTS)
    assert run.returncode == 0, run.stdout + run.stderr
    found = results(run.stdout)
    assert sorted(found) == [0, 1, 2]
    assert all(f["sum"] == "6" and f["world"] == "3" for f in found.values())
    assert sorted(f["host"] for f in found.values()) == ["node1", "node1", "node3"]


def printed(stdout: str, marker: str) -> dict[int, dict[str, str]]:
    """rank -> the KEY=VALUE words a test script printed after ``marker`` on that rank
    (scripts/threads.py: THREADS, scripts/where.py: WHERE)."""
    found = {}
    for match in re.finditer(rf"\| {marker} (.*)$", stdout, re.M):
        fields = dict(item.split("=", 1) for item in match.group(1).split())
        found[int(fields["rank"])] = fields
    return found


def test_omp_threads_are_the_nodes_cores_shared_by_its_workers(
    testbed: Testbed, tmp_path: Path
) -> None:
    nodes: list[str | dict[str, object]] = [
        {"host": "node1", "nproc": 1},
        {"host": "node2", "nproc": 2},
    ]
    run = herd(
        ["launch", "-c", str(cluster(testbed, tmp_path, nodes)), "threads.py"],
        tmp_path / "home",
        SCRIPTS,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = printed(run.stdout, "THREADS")
    assert sorted(found) == [0, 1, 2], run.stdout
    for fields in found.values():
        share = max(1, int(fields["cores"]) // int(fields["local_world"]))
        assert fields["omp"] == str(share), fields  # torchrun alone would give 1 worker none
        assert fields["torch"] == str(share), fields  # and torch really uses that many
    # Set by the user: kept as it is on every node.
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=nodes,
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "3"},
    )
    run = herd(["launch", "-c", str(path), "threads.py"], tmp_path / "home", SCRIPTS)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {f["omp"] for f in printed(run.stdout, "THREADS").values()} == {"3"}, run.stdout


def test_script_or_module_missing_on_the_nodes_is_refused_before_launch(
    testbed: Testbed, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "not-the-project"
    elsewhere.mkdir()
    (elsewhere / "local_module.py").write_text("print('RAN local_module')\n")
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1", "node2"], workdir=str(elsewhere)
    )
    home = tmp_path / "home"
    # allreduce.py is in the launcher's current directory, not in the nodes' workdir.
    run = herd(["launch", "-c", str(path), "allreduce.py"], home, SCRIPTS)
    assert run.returncode == 3, run.stdout + run.stderr
    for node in ("node1", "node2"):
        assert f"{node}: script allreduce.py not found in {elsewhere}" in run.stderr, run.stderr
    assert "fix: `herd sync`" in run.stderr and "workdir" in run.stderr
    assert "RESULT" not in run.stdout and not (home / "jobs").exists()  # nothing was started

    run = herd(["launch", "-c", str(path), "-m", "no_such_module.train"], home, SCRIPTS)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "node2: module no_such_module.train is not importable by" in run.stderr, run.stderr

    # A module in the workdir is found from there, as `python -m` in the workdir finds it.
    run = herd(["launch", "-c", str(path), "-m", "local_module"], home, SCRIPTS)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RAN local_module" in run.stdout


def test_failing_rank_is_named_and_other_nodes_stop(testbed: Testbed, tmp_path: Path) -> None:
    path = cluster(
        testbed, tmp_path, [{"host": "node1", "nproc": 2}, {"host": "node2", "nproc": 1}]
    )
    started = time.monotonic()
    # Rank 2 (node2's only worker) dies before the all-reduce: node1's ranks would wait forever.
    run = herd(
        ["launch", "-c", str(path), "allreduce.py", "--fail-rank", "2", "--code", "3"],
        tmp_path / "home",
        SCRIPTS,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.stdout[run.stdout.index("job ") :]
    assert "first failure: node2 rank 2: exit code 3" in summary, summary
    assert "rank 2 failing on purpose with code 3" in summary  # its last stderr lines
    assert elapsed < 120, "the other node was not stopped"
    assert_nothing_left(testbed, tmp_path / "home")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_everything_within_the_readmes_bound(
    testbed: Testbed, tmp_path: Path, sig: signal.Signals
) -> None:
    """Workers that ignore SIGTERM: herd must escalate to SIGKILL after --grace, taking their
    stacks first, and the README's bound (the grace period plus 25 s for the stacks and the
    sweep) holds; then nothing herd started is left anywhere."""
    grace = 3
    path = cluster(
        testbed, tmp_path, [{"host": "node1", "nproc": 2}, {"host": "node2", "nproc": 1}]
    )
    home = tmp_path / "home"
    with ProcessWatch(testbed) as watch:
        process = start_sleeping_job(
            path, home, 3, herd_args=("--grace", str(grace)), script_args=("--ignore-sigterm",)
        )
        try:
            job_id = next((home / "jobs").iterdir()).name
            assert (
                len(testbed.processes_with_env("HERD_JOB_ID", job_id)) >= 5
            )  # 2 torchrun, 3 ranks
            started = time.monotonic()
            process.send_signal(sig)
            rest = process.communicate(timeout=grace + 25 + 30)[0]
            took = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 130, rest
        assert "interrupted" in rest
        assert took <= grace + 25, f"took {took:.1f} s to stop (README: grace + 25 s)"
        assert_all_stopped(watch, ["node1", "node2"])
    # Workers still running past the grace period: their stacks were taken before the kill.
    stacks_dir = home / "jobs" / job_id / "stacks" / "attempt-0"
    summary = json.loads((stacks_dir / "summary.json").read_text())
    after_grace = f"still running {grace} s after SIGTERM"
    assert summary["reasons"] == {"node1": after_grace, "node2": after_grace}, summary
    assert [(r["host"], r["rank"], r["error"]) for r in summary["ranks"]] == [
        ("node1", 0, None),
        ("node1", 1, None),
        ("node2", 2, None),
    ], summary
    assert "allreduce.py" in (stacks_dir / "node2-rank-2.txt").read_text()
    assert not testbed.processes_with_env("HERD_JOB_ID", job_id)


def test_launcher_killed_agents_end_the_job(testbed: Testbed, tmp_path: Path) -> None:
    path = cluster(
        testbed, tmp_path, [{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}]
    )
    home = tmp_path / "home"
    process = start_sleeping_job(path, home, 2, start_new_session=True)
    try:
        # SIGKILL the launcher and its ssh clients: the links drop, as when a laptop dies.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    # No herd is left to wait for the agents: they notice the dropped links themselves; the
    # ssh masters (daemons of their own) go ControlPersist (30 s) after their last session.
    assert_nothing_left(testbed, home, settle=45, job_grace=15)
    # Its record still says "running" (nobody was left to write how it ended): `herd ps`
    # sees that its launcher is gone and shows it as lost.
    (job,) = [p.name for p in (home / "jobs").iterdir()]
    assert json.loads((home / "jobs" / job / "job.json").read_text())["state"] == "running"
    listed = herd(["ps", "--json"], home, SCRIPTS)
    assert listed.returncode == 0, listed.stderr
    assert [(r["id"], r["state"]) for r in json.loads(listed.stdout)] == [(job, "lost")]
    table = herd(["ps"], home, SCRIPTS).stdout
    assert any(line.startswith(job) and " lost " in line for line in table.splitlines()), table


def test_unreachable_node_is_named_within_connect_timeout(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    testbed.partition("node4")
    path = cluster(testbed, tmp_path, ["node1", "node4"], connect_timeout=3)
    started = time.monotonic()
    run = herd(["launch", "-c", str(path), "allreduce.py"], tmp_path / "home", SCRIPTS)
    elapsed = time.monotonic() - started
    assert run.returncode == 3, run.stdout + run.stderr
    assert "node4: connection timed out" in run.stderr, run.stderr
    assert "node1" not in run.stderr.split("unreachable", 1)[1].split("fix:")[0]
    assert elapsed < 3 + 8, f"took {elapsed:.1f} s"


def test_local_mode_with_nproc(tmp_path: Path) -> None:
    run = herd(["launch", "--nproc", "2", "allreduce.py"], tmp_path / "home", SCRIPTS)
    assert run.returncode == 0, run.stdout + run.stderr
    found = results(run.stdout)
    assert sorted(found) == [0, 1] and all(f["sum"] == "3" for f in found.values())


@pytest.mark.parametrize(
    ("args", "text", "files"),
    [
        (["launch", "missing.py"], "training script missing.py not found", {}),
        (
            ["launch", "-c", "bad.toml", "allreduce.py"],
            "line 2",
            {"bad.toml": "[[node]]\nhost = \n"},
        ),
        (
            ["launch", "-c", "bad.toml", "allreduce.py"],
            "unknown key 'nprocs'",
            {"bad.toml": '[[node]]\nhost = "a"\nnprocs = 2\n'},
        ),
        (["launch", "-c", "bad.toml", "allreduce.py"], "no nodes", {"bad.toml": "[cluster]\n"}),
        (["launch"], "no training script", {}),
    ],
)
def test_bad_input_is_one_clear_error(
    tmp_path: Path, args: list[str], text: str, files: dict[str, str]
) -> None:
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    shutil_copy = tmp_path / "allreduce.py"
    shutil_copy.write_text((SCRIPTS / "allreduce.py").read_text())
    run = herd(args, tmp_path / "home", tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert text in run.stderr
    assert "Traceback" not in run.stderr and "fix:" in run.stderr


def test_ctrl_c_while_connecting_leaves_no_ssh_behind(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    testbed.partition("node2")  # its connection attempt hangs until ConnectTimeout (20 s)
    path = cluster(testbed, tmp_path, ["node1", "node2"], connect_timeout=20)
    with ProcessWatch(testbed) as watch:
        process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", "launch", "-c", str(path), "allreduce.py"],
            cwd=SCRIPTS,
            env=dict(os.environ, HERD_HOME=str(tmp_path / "home")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # Interrupt only once herd is connecting to both nodes (its ssh clients exist):
            # before that there is nothing to clean up, and the test would prove nothing.
            wait_for(
                lambda: watch.ssh_to("node1") and watch.ssh_to("node2"),
                timeout=60,
                what="herd's ssh clients to node1 and node2",
            )
            process.send_signal(signal.SIGINT)
            err = process.communicate(timeout=10)[1]
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 130, err
        assert "nothing was started" in err
        assert_all_stopped(watch, ["node1", "node2"])
    assert watch.control_dirs, "herd's ssh clients were never seen"
