"""Secrets end to end on the testbed: env_file values reach the job's environment over ssh's
stdin, and appear on no command line on any node, in no log, dry-run output or job record.

Sentinels: values of an env_file (all masked by value), and a secret-named variable in
[cluster] env (masked by name). The worker proves it received them by printing a hash.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path

from tests.integration.herd_cli import herd
from tests.integration.procs import ProcessWatch
from tests.testbed import Testbed

NAMES = ("HERD_SENTINEL_TOKEN", "PLAIN_VALUE", "WANDB_API_KEY")
JOB = """\
import hashlib, os, sys, time
NAMES = NAMES_HERE
rank = int(os.environ["RANK"])
got = hashlib.sha256("|".join(os.environ.get(n, "") for n in NAMES).encode()).hexdigest()
print(f"rank {rank}: secrets {'ok' if got == sys.argv[1] else 'WRONG'}", flush=True)
if sys.argv[2] == "leak" and rank == 0:
    print("the token is " + os.environ["HERD_SENTINEL_TOKEN"], flush=True)
    raise SystemExit("failing with " + os.environ["HERD_SENTINEL_TOKEN"])
time.sleep(3 if sys.argv[2] == "brief" else 60)
""".replace("NAMES_HERE", repr(NAMES))


def command_lines_with(values: list[str]) -> list[str]:
    """Command lines of every process on this machine (all testbed nodes share its pids)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        if any(v in cmdline for v in values):
            found.append(f"{entry}: {cmdline}")
    return found


def files_with(root: Path, values: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not any(part in skip for part in path.parts):
            data = path.read_bytes()
            if any(v.encode() in data for v in values):
                found.append(str(path))
    return found


def secret_project(testbed: Testbed, tmp_path: Path) -> tuple[dict[str, str], Path, Path, Path]:
    """Sentinel secrets, a project with job.py, and a cluster file with an env_file."""
    secrets = {name: f"sentinel-{name.lower()}-{uuid.uuid4().hex}" for name in NAMES}
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (project / "job.py").write_text(JOB)
    env_file = tmp_path / "secrets.env"
    env_file.write_text(
        f"HERD_SENTINEL_TOKEN={secrets['HERD_SENTINEL_TOKEN']}\n"
        f"export PLAIN_VALUE='{secrets['PLAIN_VALUE']}'\n"
    )
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", "node2"],
        workdir=str(project),
        env={"HERD_HOME": str(home), "WANDB_API_KEY": secrets["WANDB_API_KEY"]},
        env_file=str(env_file),
    )
    return secrets, project, home, config


def test_secrets_reach_the_job_and_nothing_else(testbed: Testbed, tmp_path: Path) -> None:
    secrets, project, home, config = secret_project(testbed, tmp_path)
    values = list(secrets.values())
    digest = hashlib.sha256("|".join(secrets[n] for n in NAMES).encode()).hexdigest()

    dry = herd(["launch", "-c", str(config), "--dry-run", "job.py", digest, "quiet"], home, project)
    assert dry.returncode == 0, dry.stderr
    assert "HERD_SENTINEL_TOKEN=********" in dry.stdout and "WANDB_API_KEY=********" in dry.stdout
    assert not any(v in dry.stdout + dry.stderr for v in values)

    # A detached job that keeps quiet: then no file herd or torchrun writes holds a secret.
    launched = herd(
        ["launch", "-c", str(config), "--detach", "job.py", digest, "quiet"], home, project
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr
    job = next((home / "jobs").iterdir()).name
    try:
        events = [home / "nodes" / job / n / "events.jsonl" for n in ("node1", "node2")]
        deadline = time.monotonic() + 90
        while not all(p.exists() and "secrets ok" in p.read_text() for p in events):
            assert "secrets WRONG" not in "".join(p.read_text() for p in events if p.exists())
            assert time.monotonic() < deadline, "the workers never reported their secrets"
            time.sleep(0.2)
        assert command_lines_with(values) == []  # while every process of the job runs
        shown = (
            herd(["logs", job], home, project).stdout + herd(["ps", "--json"], home, project).stdout
        )
        assert "node2:1 | rank 1: secrets ok" in shown
    finally:
        assert herd(["stop", job], home, project).returncode == 0
    assert not any(v in shown for v in values)
    assert files_with(home, values) == []  # records, launcher logs, node events, torchrun logs

    # An attached job whose rank 0 prints a secret and fails with it: herd masks it everywhere
    # it writes. (Only what the workers write themselves, torchrun's per-rank files and error
    # record on the node, holds their raw output.)
    failed = herd(["launch", "-c", str(config), "job.py", digest, "leak"], home, project)
    assert failed.returncode == 1
    assert "node1:0 | the token is ********" in failed.stdout
    assert "failing with ********" in failed.stdout  # the first-failure summary
    assert not any(v in failed.stdout + failed.stderr for v in values)
    jobs = sorted((home / "jobs").iterdir(), key=lambda p: p.stat().st_mtime)
    logs = herd(["logs", jobs[-1].name], home, project).stdout
    assert "the token is ********" in logs and not any(v in logs for v in values)
    assert files_with(home, values, skip=("torchrun", "failure.json")) == []


def test_no_command_line_ever_holds_a_secret_during_an_attached_run_or_exec(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Command lines are sampled every 20 ms for the whole of an attached run, whose ssh clients
    (carrying the job request) live as long as the job; and through `herd exec`, which must
    not receive the env_file's values at all."""
    secrets, project, home, config = secret_project(testbed, tmp_path)
    values = list(secrets.values())
    digest = hashlib.sha256("|".join(secrets[n] for n in NAMES).encode()).hexdigest()
    with ProcessWatch(testbed, secrets=tuple(values)) as watch:
        run = herd(["launch", "-c", str(config), "job.py", digest, "brief"], home, project)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "node2:1 | rank 1: secrets ok" in run.stdout
    assert watch.ssh_clients, "the watch never saw herd's ssh clients"
    assert watch.samples > 20
    assert watch.leaked == []

    env_file_values = [secrets["HERD_SENTINEL_TOKEN"], secrets["PLAIN_VALUE"]]
    with ProcessWatch(testbed, secrets=tuple(values)) as watch:
        shown = herd(["exec", "-c", str(config), "--", "env"], home, project)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "SSH_CONNECTION=" in shown.stdout  # it did print the nodes' environment
    assert not any(v in shown.stdout + shown.stderr for v in env_file_values)
    assert "HERD_SENTINEL_TOKEN" not in shown.stdout
    assert watch.ssh_clients and watch.leaked == []
