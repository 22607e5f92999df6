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

from tests.integration.herd_cli import herd
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


def test_a_worker_that_imported_torch_leaves_its_heap_frozen_after_finalising_its_garbage(
    tmp_path: Path,
) -> None:
    """The last exit handler collects, then freezes: the shutdown's sweeps skip torch's heap
    (bench/worker_exit.py measures the CPU), and garbage there is at exit is still
    finalised (a reference cycle whose __del__ writes a file)."""
    marker = tmp_path / "finalised"
    script = (
        "import atexit, gc, sys\n"
        "import torchherd.exit_guard as guard\n"
        "guard.install()\n"
        "{imports}\n"
        "class Cycle:\n"
        "    def __del__(self):\n"
        f"        open({str(marker)!r}, 'w').write('yes')\n"
        "cycle = Cycle(); cycle.me = cycle; del cycle\n"
        "atexit._run_exitfuncs()\n"
        "print(gc.get_freeze_count())\n"
    )
    with_torch = python(script.format(imports="import torch"), HERD_JOB_ID="j", RANK="0")
    assert int(with_torch.stdout.split()[-1]) > 10_000, with_torch.stderr
    assert marker.read_text() == "yes"  # collected before the freeze
    marker.unlink()
    # No torch, nothing frozen: a small process has no heap worth sparing.
    plain = python(script.format(imports=""), HERD_JOB_ID="j", RANK="0")
    assert int(plain.stdout.split()[-1]) == 0, plain.stderr
    assert marker.read_text() == "yes"


def test_a_worker_started_by_herd_launch_has_the_wait(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(
        "import sys, torchherd.exit_guard as guard\n"
        "print('guard installed:', guard._installed, flush=True)\n"
    )
    run = herd(["launch", "--nproc", "1", "probe.py"], tmp_path / "home", tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "guard installed: True" in run.stdout


def test_the_wait_spares_workers_the_abort_that_plain_processes_meet() -> None:
    # The effect itself, side by side: the plain two-rank DDP script of bench/exit_guard.py,
    # ending on un-awaited all-reduces (Gloo's threads still busy as the interpreter shuts
    # down), in real interpreters: without the guard most runs abort (SIGABRT), with herd's
    # worker environment none does. bench/exit_guard.py runs the long count, and the plain
    # script without the async ending.
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "exit_guard.py"
    spec = importlib.util.spec_from_file_location("exit_guard_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # The abort is a race: a quiet machine may need more than one round of 4 to show it once.
    # Rounds go on (both sides each time) until the unguarded side has aborted, at most 4.
    totals: dict[bool, dict[str, int]] = {False: {}, True: {}}
    runs = 0
    while runs < 16 and not totals[False].get("abort"):
        for side, outcomes in bench.count(runs=4, parallel=2, async_last=True, say=False).items():
            for outcome, n in outcomes.items():
                totals[side][outcome] = totals[side].get(outcome, 0) + n
        runs += 4
    without, with_guard = totals[False].get("abort", 0), totals[True].get("abort", 0)
    print(f"aborts without the guard: {without} of {runs}; with it: {with_guard} of {runs}")
    assert with_guard == 0, totals
    assert without >= 1, totals  # the abort is real here, so the guard's 0 means something
    assert totals[True].get("ok") == runs, totals
