"""Replica groups that start together (no testbed: two torchruns on this machine, each a group
of two workers, with torchft's real lighthouse and Manager).

The lighthouse here waits for both groups (--min_replicas=2), so the first quorum holds both at
step 0, which herd's own lighthouse (--min_replicas=1) gets whenever the groups come up within
its join window. The groups also start from different weights (each its own --seed), as they do
in a script that does not seed its model. Every worker of both groups must end with the same
weights: one model was trained, not two, and no worker of a group drifted from its partner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.herd_cli import SCRIPTS
from tests.ports import free_port

pytest.importorskip("torchft", reason="replica groups need torchft (pip install -e '.[dev]')")

STEPS = 6
GROUPS = 2
WORKERS = 2
WAIT_S = 180


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def end(process: subprocess.Popen[bytes]) -> None:
    """Ends a process this test started and everything in its session (torchrun's workers)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_groups_that_start_together_from_different_weights_train_one_model(
    tmp_path: Path,
) -> None:
    lighthouse_port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HERD_", "TORCHFT_"))}
    lighthouse = start(
        [
            sys.executable,
            "-m",
            "torchherd.train.lighthouse",
            f"--min_replicas={GROUPS}",
            f"--bind=127.0.0.1:{lighthouse_port}",
        ],
        tmp_path / "lighthouse.log",
        base,
    )
    groups: list[subprocess.Popen[bytes]] = []
    try:
        for group in range(GROUPS):
            env = {
                **base,
                "HERD_REPLICA_GROUPS": str(GROUPS),
                "HERD_REPLICA_GROUP": str(group),
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
                "HERD_GROUP_ADDR": "127.0.0.1",
                "TORCHFT_TIMEOUT_SEC": "30",
                "RUST_LOG": "warn",
            }
            script = [
                str(SCRIPTS / "groups_minimal.py"),
                *("--max-steps", str(STEPS), "--batch-size", "16"),
                *("--seed", str(7 + group), "--run-dir", str(tmp_path / "run")),
            ]
            groups.append(
                start(
                    [
                        *(sys.executable, "-m", "torch.distributed.run"),
                        *("--nproc-per-node", str(WORKERS), "--master-addr", "127.0.0.1"),
                        *("--master-port", str(free_port())),
                        *script,
                    ],
                    tmp_path / f"group{group}.log",
                    env,
                )
            )
        codes = [group.wait(timeout=WAIT_S) for group in groups]
    finally:
        for process in [*groups, lighthouse]:
            end(process)
    logs = "\n".join((tmp_path / f"group{g}.log").read_text()[-3000:] for g in range(GROUPS))
    assert codes == [0] * GROUPS, logs
    # weights-<group>.json from a group's rank 0, weights-<group>-<rank>.json from the others
    names = [f"{g}" if r == 0 else f"{g}-{r}" for g in range(GROUPS) for r in range(WORKERS)]
    ends = {n: json.loads((tmp_path / "run" / f"weights-{n}.json").read_text()) for n in names}
    assert [end["step"] for end in ends.values()] == [STEPS] * len(names)
    first = ends[names[0]]["weights"]
    differing = [n for n in names[1:] if ends[n]["weights"] != first]
    assert not differing, f"workers {differing} ended with other weights than worker {names[0]}"
