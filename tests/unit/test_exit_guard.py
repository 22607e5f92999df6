"""herd's workers wait at exit with the GIL free, so Gloo's threads can finish releasing the
last collectives before the interpreter shuts down (torchherd/exit_guard.py says why).

Only herd's workers get the wait: their PYTHONPATH starts with torchherd's worker site, whose
sitecustomize installs it. Nothing is registered for the whole environment, so `import torch`
anywhere else neither runs herd's code nor breaks when torchherd cannot be imported. That the
wait prevents the abort is measured by bench/exit_guard.py (abort counts, with and without).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchherd.exit_guard import WORKER_SITE, for_workers

COUNT = (
    "import atexit; before = atexit._ncallbacks(); import torch; "
    "print(atexit._ncallbacks() - before)"
)


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("HERD_JOB_ID", "RANK")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_torch_elsewhere_never_runs_herds_code() -> None:
    # Even with a worker's variables set, a process herd did not start through its wrapper
    # registers nothing: no plugin runs at `import torch`.
    done = python(
        COUNT + "; import sys; print('torchherd' in sys.modules)", HERD_JOB_ID="j", RANK="0"
    )
    assert done.returncode == 0, done.stderr
    registered, loaded = done.stdout.split()[-2:]
    assert loaded == "False"
    assert int(registered) == int(python(COUNT).stdout.split()[-1])


def test_a_broken_torchherd_cannot_break_import_torch() -> None:
    # A moved editable checkout: torchherd's metadata is there, its code cannot be imported.
    # A torch plugin entry point made every `import torch` there fail with RuntimeError.
    done = python("import sys; sys.modules['torchherd'] = None; import torch; print('ok')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_herds_workers_get_the_wait_and_keep_their_own_sitecustomize(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins; builtins.OWN_SITE = True\n")
    env = {"PYTHONPATH": str(own)}
    for_workers(env)
    assert env["PYTHONPATH"].split(os.pathsep) == [WORKER_SITE, str(own)]
    probe = (
        "import sys, builtins; import torchherd.exit_guard as guard; "
        "print(guard._installed, getattr(builtins, 'OWN_SITE', False), "
        f"{WORKER_SITE!r} in sys.path)"
    )
    worker = python(probe, HERD_JOB_ID="job", RANK="0", **env)
    assert worker.stdout.split() == ["True", "True", "False"], worker.stderr
    # torchrun's own agent has the job id but no RANK: no wait there
    agent = python(probe, HERD_JOB_ID="job", **env)
    assert agent.stdout.split()[0] == "False"


def test_the_wait_happens_only_where_torch_distributed_was_imported() -> None:
    script = (
        "import atexit, time, sys\n"
        "import torchherd.exit_guard as guard\n"
        "guard.install()\n"
        "{imports}\n"
        "start = time.monotonic(); atexit._run_exitfuncs()\n"
        "print(round(time.monotonic() - start, 2))\n"
    )
    plain = python(script.format(imports=""), HERD_JOB_ID="job", RANK="0")
    assert float(plain.stdout.split()[-1]) < 0.2, plain.stderr
    distributed = python(
        script.format(imports="import torch.distributed"), HERD_JOB_ID="j", RANK="0"
    )
    assert float(distributed.stdout.split()[-1]) >= 0.25, distributed.stderr


def test_a_worker_started_by_herd_launch_has_the_wait(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(
        "import sys, torchherd.exit_guard as guard\n"
        "print('guard installed:', guard._installed, flush=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "torchherd", "launch", "--nproc", "1", "probe.py"],
        cwd=tmp_path,
        env=dict(os.environ, HERD_HOME=str(tmp_path / "home")),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "guard installed: True" in run.stdout
