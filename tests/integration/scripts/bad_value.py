"""examples/minimal.py (slowed as slow_minimal.py) whose highest rank raises
``ValueError: bad value 42`` once the snapshot at step 20 exists, while the other ranks wait in
their all-reduce: a failed job, for the report page's and the console's tests."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import os  # noqa: E402

import minimal  # noqa: E402

from torchherd import train  # noqa: E402

supervised = train.supervised
victim = os.environ["RANK"] == str(int(os.environ["WORLD_SIZE"]) - 1)
run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])


def check(value: int) -> None:
    raise ValueError(f"bad value {value}")


def slow_supervised(loss):  # type: ignore[no-untyped-def]
    step = supervised(loss)

    def slowed(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        if victim and (run_dir / "snapshots" / "step-20").exists():
            check(42)
        return step(*args, **kwargs)

    return slowed


train.supervised = slow_supervised
raise SystemExit(minimal.main())
