"""Job control pieces that run without ssh: records, agent verbs on this machine, redaction."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from torchherd.agent import control
from torchherd.agent.detach import FileEmitter
from torchherd.errors import ConfigError
from torchherd.job_nodes import cluster_from_record, cluster_snapshot
from torchherd.launcher.detach import detach_request
from torchherd.ops.jobctl import apply_status, find_record
from torchherd.ops.joblogs import format_event
from torchherd.plan import LaunchPlan, NodePlan
from torchherd.records import JobRecord, load_record
from torchherd.spec import parse_host_list
from torchherd.transport.agent_call import AgentAnswer


@pytest.fixture(autouse=True)
def herd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def record(job_id: str = "1122-000000-abcd", **fields: Any) -> JobRecord:
    values: dict[str, Any] = dict(
        id=job_id,
        state="running",
        started=time.time() - 5,
        source="herd.toml",
        nodes=[{"host": "gpu1", "nproc": 2}, {"host": "bob@gpu2", "nproc": 1}],
        world_size=3,
        command=["python"],
        rdzv_endpoint=None,
        log_dir="/tmp",
        detached=True,
    )
    values.update(fields)
    return JobRecord(**values)


def test_cluster_snapshot_masks_secrets_and_round_trips(tmp_path: Path) -> None:
    cluster = parse_host_list(
        "gpu1:2,bob@gpu2",
        ssh_config="cfg",
        env_file=".env",
        env={"HF_TOKEN": "abc", "NCCL_DEBUG": "WARN", "X": "val-s3cret"},
    )
    snap = cluster_snapshot(cluster, secrets=["val-s3cret"])
    assert snap["env"] == {"HF_TOKEN": "********", "NCCL_DEBUG": "WARN", "X": "********"}
    assert snap["ssh_config"] == os.path.abspath("cfg")
    again = cluster_from_record(record(cluster=snap))
    assert [n.host for n in again.nodes] == ["gpu1", "bob@gpu2"]
    assert again.env == {"NCCL_DEBUG": "WARN"}  # masked values are not sent anywhere
    with pytest.raises(ConfigError, match="does not record its cluster"):
        cluster_from_record(record())


def test_find_record_by_prefix() -> None:
    record("1122-000000-aaaa").save()
    record("1122-000000-aabb").save()
    assert find_record("1122-000000-aaaa").id == "1122-000000-aaaa"
    assert find_record("1122-000000-aab").id == "1122-000000-aabb"
    with pytest.raises(ConfigError, match="ambiguous"):
        find_record("1122-000000-aa")
    with pytest.raises(ConfigError, match="no job 'zzz'"):
        find_record("zzz")


def answer(host: str, **data: Any) -> AgentAnswer:
    return AgentAnswer(host, {"agent": None, "processes": 0, "exit": None, **data})


def test_apply_status_keeps_running_jobs_and_records_how_they_ended() -> None:
    job = record()
    apply_status(job, [answer("gpu1", agent=123), answer("bob@gpu2")])
    assert job.state == "running"
    apply_status(job, [answer("gpu1"), AgentAnswer("bob@gpu2", None, "unreachable")])
    assert job.state == "running"  # a node we cannot see may still run it
    apply_status(
        job,
        [
            answer("gpu1", exit={"code": 0, "ts": 10.0}),
            answer("bob@gpu2", exit={"code": 0, "ts": 12.0}),
        ],
    )
    assert (job.state, job.exit_code, job.ended) == ("succeeded", 0, 12.0)
    failed = record("1122-000000-ffff")
    failure = {"rank": 2, "exitcode": 1, "signal": None, "message": "boom\nmore", "timestamp": 5}
    apply_status(
        failed,
        [
            answer(
                "gpu1",
                exit={
                    "code": 1,
                    "failures": [
                        {
                            "rank": 0,
                            "exitcode": -15,
                            "signal": "SIGTERM",
                            "message": "",
                            "timestamp": 4,
                        }
                    ],
                },
            ),
            answer("bob@gpu2", exit={"code": 1, "failures": [failure]}),
        ],
    )
    assert failed.state == "failed" and failed.first_failure is not None
    assert failed.first_failure["host"] == "bob@gpu2"  # the cause, not the teardown kill
    assert failed.first_failure["message"] == "boom"
    assert load_record(failed.id) is not None and load_record(failed.id).state == "failed"


def test_detach_request_is_the_attempts_request_plus_detach(tmp_path: Path) -> None:
    node = NodePlan(
        host="bob@gpu2",
        name="gpu2",
        python="python3",
        nproc=1,
        local_addr="1.2.3.4",
        iface="eth0",
        is_host=False,
        argv=("python3", "-m", "x"),
        env={"A": "1"},
    )
    plan = LaunchPlan(
        job_id="j1",
        rdzv_endpoint="1.2.3.4:29400",
        world_size=1,
        nodes=(node,),
        workdir="~/p",
        grace=7.0,
        secret_env={"TOKEN": "t0ps3cret"},
    )
    request = detach_request(plan, node)
    # Written out from the plan above, not computed by the code under test. No heartbeat:
    # a detached agent has nobody to hear from.
    assert request == {
        "job_id": "j1",
        "node": "gpu2",
        "workdir": "~/p",
        "argv": ["python3", "-m", "x"],
        "env": {"A": "1"},
        "secret_env": {"TOKEN": "t0ps3cret"},
        "grace": 7.0,
        "report_every": 1.0,  # the node's progress reports: every second on a small job
        "detach": True,
    }


def test_file_emitter_masks_secrets_and_relays_the_first_event(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    emit = FileEmitter(str(tmp_path / "events.jsonl"), write_fd, ['s3cr"et-value', "abc"])
    emit({"e": "started", "host": "n1", "pid": 1, "node_dir": "d"})
    emit({"e": "line", "r": 0, "l": 0, "s": "o", "t": 'token s3cr"et-value, abc'})
    relayed = os.read(read_fd, 1 << 16)
    assert json.loads(relayed)["e"] == "started"
    assert os.read(read_fd, 10) == b""  # closed after the first event
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["t"] == "token ********, abc"  # "abc" too short to mask
    assert all("ts" in json.loads(line) for line in lines)


def stand_in_agent(
    node_dir: Path, job_id: str, node: str, detached: bool, attempt: str | None = None
) -> subprocess.Popen[str]:
    """A process that, like a real agent, leaves its record and ends on SIGTERM; returned
    once the record is written."""
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from torchherd.agent.control import write_agent_record as w; "
                f"w({str(node_dir)!r}, {job_id!r}, {node!r}, {detached!r}, attempt={attempt!r}); "
                "print('ready', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
    return agent


def test_agent_record_and_stop_verb_end_exactly_the_job(tmp_path: Path) -> None:
    job_id, node = uuid.uuid4().hex, "n1"
    node_dir = tmp_path / "nodes" / job_id / node
    node_dir.mkdir(parents=True)
    env = dict(os.environ, HERD_JOB_ID=job_id, HERD_NODE=node)
    victims = [subprocess.Popen(["sleep", "60"], env=env) for _ in range(2)]
    other = subprocess.Popen(["sleep", "60"], env=dict(env, HERD_NODE="n2"))
    agent = stand_in_agent(node_dir, job_id, node, detached=True)
    try:
        assert control.live_agent(str(node_dir)) == agent.pid
        result = control.stop(
            {"job_id": job_id, "node": node, "node_dir": str(node_dir), "grace": 2}
        )
        assert result["agent"] == agent.pid and result["processes"] == 2
        assert result["survivors"] == [] and result["agent_left"] is False
        for victim in victims:
            assert victim.wait(timeout=5) is not None
        assert other.poll() is None  # same job, another node: untouched
        assert control.live_agent(str(node_dir)) is None
    finally:
        for process in (*victims, other, agent):
            process.kill()
            process.wait(timeout=10)


def test_logs_verb_filters_ranks_and_stops_at_the_exit_event(tmp_path: Path) -> None:
    events = [
        {"e": "started", "host": "n1"},
        {"e": "line", "r": 0, "t": "zero"},
        {"e": "line", "r": 1, "t": "one"},
        {"e": "line", "r": None, "t": "agent"},
        {"e": "exit", "code": 0, "stopped": False},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    out = io.BytesIO()
    request = {"node_dir": str(tmp_path), "rank": 1, "follow": True}
    assert control.logs(request, out, watch_stdin=False) == 0
    sent = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e.get("t") for e in sent if e["e"] == "line"] == ["one"]
    assert sent[-1]["e"] == "exit"
    width = 6
    assert format_event("n1", events[1], width, None) == "n1:0   | zero"
    assert format_event("n1", events[3], width, None) == "n1     | agent"
    assert format_event("n1", events[1], width, 0) == "zero"
    ended = format_event("n1", events[4], width, None)
    assert ended == "n1     | herd: job ended on n1 (exit code 0)"
    assert format_event("n1", events[0], width, None) is None


def test_detached_start_stops_the_started_nodes_when_one_cannot_start(
    tmp_path: Path, herd_home: Path
) -> None:
    """Two "nodes" on the local transport: a starts (a real detached agent), b's python is
    missing. The job needs every node, so a is stopped again and the record says failed."""
    import asyncio

    from torchherd.launcher.detach import start_detached
    from torchherd.transport.local import LocalTransport

    cluster = parse_host_list("a,b").model_copy(
        update={"transport": "local", "python": sys.executable}
    )
    cluster = cluster.model_copy(
        update={
            "nodes": (
                cluster.nodes[0],
                cluster.nodes[1].model_copy(update={"python": "/nonexistent/py"}),
            )
        }
    )
    job_id = "1122-000000-" + uuid.uuid4().hex[:4]
    nodes = tuple(
        NodePlan(
            host=h,
            name=h,
            python=sys.executable,
            nproc=1,
            local_addr=None,
            iface=None,
            is_host=h == "a",
            argv=("sleep", "60"),
            env={},
        )
        for h in ("a", "b")
    )
    plan = LaunchPlan(
        job_id=job_id,
        rdzv_endpoint=None,
        world_size=2,
        nodes=nodes,
        workdir=None,
        grace=1.0,
        secret_env={},
    )
    stream = io.StringIO()
    result = asyncio.run(start_detached(cluster, plan, LocalTransport(cluster), stream))
    assert result.exit_code == 3 and result.node_status == {"a": "stopped", "b": "not started"}
    assert "b did not start" in stream.getvalue() and "stopping the job on a" in stream.getvalue()
    saved = load_record(job_id)
    assert saved is not None and saved.state == "failed" and saved.detached
    tagged = [
        p
        for p in os.listdir("/proc")
        if p.isdigit() and f"HERD_JOB_ID={job_id}".encode() in _environ(p)
    ]
    assert tagged == []


def _environ(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def test_a_sweep_of_one_attempt_spares_the_restarted_attempt(tmp_path: Path) -> None:
    """The launcher sweeps what a lost agent left (attempt 0) while the restart (attempt 1)
    may already be starting on the same node: only attempt 0's processes end, and the agent
    on record, being attempt 1's, is not signalled."""
    job_id, node = uuid.uuid4().hex, "n1"
    node_dir = tmp_path / "nodes" / job_id / node
    node_dir.mkdir(parents=True)
    env = dict(os.environ, HERD_JOB_ID=job_id, HERD_NODE=node)
    left = subprocess.Popen(["sleep", "60"], env=dict(env, HERD_ATTEMPT="0"))
    restarted = subprocess.Popen(["sleep", "60"], env=dict(env, HERD_ATTEMPT="1"))
    agent = stand_in_agent(node_dir, job_id, node, detached=False, attempt="1")
    try:
        result = control.stop(
            {"job_id": job_id, "node": node, "node_dir": str(node_dir), "grace": 2, "attempt": 0}
        )
        assert result["agent"] is None and result["processes"] == 1
        assert left.wait(timeout=5) is not None
        assert restarted.poll() is None and agent.poll() is None
        assert control.live_agent(str(node_dir)) == agent.pid  # `herd stop` still finds it
    finally:
        for process in (left, restarted, agent):
            process.kill()
            process.wait(timeout=10)


def test_an_unknown_job_lists_the_users_jobs_not_herds_own() -> None:
    record("1122-000000-user").save()
    record("1122-000001-bnch", kind="bench").save()
    record("1122-000002-doct", kind="doctor").save()
    with pytest.raises(ConfigError) as refused:
        find_record("nosuch")
    assert "1122-000000-user" in refused.value.remedy
    assert "bnch" not in refused.value.remedy and "doct" not in refused.value.remedy
