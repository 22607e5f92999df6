"""examples/minimal.py run as replica groups (herd launch --replica-groups): every step slowed
by 50 ms so a test can kill a group mid-run; at the end each group writes its weights to
<run-dir>/weights-<group>.json (a group's other ranks: weights-<group>-<rank>.json; without
groups: weights-<rank>.json), so a test can compare
the groups' weights; it also runs as a plain job (bench/train_through.py's baseline)."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import minimal  # noqa: E402

from torchherd import train  # noqa: E402

supervised = train.supervised
fit = train.Trainer.fit


def slow_supervised(loss):  # type: ignore[no-untyped-def]
    step = supervised(loss)

    def slowed(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.05)
        return step(*args, **kwargs)

    return slowed


def fit_and_write(self):  # type: ignore[no-untyped-def]
    result = fit(self)
    rank = os.environ.get("RANK", "0")
    group = os.environ.get("HERD_REPLICA_GROUP")
    # weights-<group>.json from a group's rank 0 (its other ranks: weights-<group>-<rank>.json)
    name = rank if group is None else group if rank == "0" else f"{group}-{rank}"
    weights = [p.detach().flatten().tolist() for p in self.module.parameters()]
    out = Path(self.config.run_dir) / f"weights-{name}.json"
    out.write_text(json.dumps({"step": self.step, "weights": weights}))
    return result


train.supervised = slow_supervised
train.Trainer.fit = fit_and_write
raise SystemExit(minimal.main())
