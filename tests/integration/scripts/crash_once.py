"""examples/minimal.py (slowed as slow_minimal.py) whose highest rank kills itself with SIGKILL
in herd's first attempt, once the snapshot at step 40 exists: a job with one restart that
resumes and finishes, for the report page's test. It writes the wall time of each attempt's
first step per rank and of the kill into the run directory (the test's own clock of a start).
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import minimal  # noqa: E402

from torchherd import train  # noqa: E402

supervised = train.supervised
victim = os.environ.get("HERD_ATTEMPT") == "0" and os.environ["RANK"] == str(
    int(os.environ["WORLD_SIZE"]) - 1
)
run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])


def slow_supervised(loss):  # type: ignore[no-untyped-def]
    step = supervised(loss)

    first = [True]

    def slowed(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        if victim and (run_dir / "snapshots" / "step-40").exists():
            (run_dir / "killed-at").write_text(f"{time.time():.4f}")
            os.kill(os.getpid(), signal.SIGKILL)
        done = step(*args, **kwargs)
        if first[0]:  # the test's own clock of each attempt's first step, per rank
            first[0] = False
            mark = f"first-step-{os.environ['HERD_ATTEMPT']}-{os.environ['RANK']}"
            (run_dir / mark).write_text(f"{time.time():.4f}")
        return done

    return slowed


train.supervised = slow_supervised
raise SystemExit(minimal.main())
