"""examples/minimal.py with every training step slowed by 20 ms, so a test can kill a worker
mid-run (SLOW_FIRST_ATTEMPT_S: a longer sleep in attempt 0, for a test that waits for
something to happen while it runs). The sleep changes no number: losses and weights are those
of the example itself. Every rank first prints `ATTEMPT rank=R attempt=A` (A: herd's
HERD_ATTEMPT)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import minimal  # noqa: E402

from torchherd import train  # noqa: E402

supervised = train.supervised
attempt = os.environ.get("HERD_ATTEMPT", "0")
pause = float(os.environ.get("SLOW_FIRST_ATTEMPT_S", "0.02")) if attempt == "0" else 0.02


def slow_supervised(loss):  # type: ignore[no-untyped-def]
    step = supervised(loss)

    def slowed(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(pause)
        return step(*args, **kwargs)

    return slowed


print(f"ATTEMPT rank={os.environ.get('RANK')} attempt={attempt}", flush=True)
train.supervised = slow_supervised
raise SystemExit(minimal.main())
