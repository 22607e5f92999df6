"""``torchherd.train``: what a training script imports to run well under ``herd launch``.

Process-group setup from torchrun's environment (``setup``/``teardown``), atomic verified
snapshots (``Snapshotter``), a sampler that resumes mid-epoch on any number of ranks
(``ResumableSampler``), and an optional loop with exact resume and metrics (``Trainer``).
Each part works alone: a hand-written DDP loop can use only the snapshots and the sampler.

This package imports torch; the launcher side of torchherd never imports it.
"""

from torchherd.train._batches import supervised
from torchherd.train.config import TrainerConfig, parse_config
from torchherd.train.data import ResumableSampler
from torchherd.train.dist import Context, setup, teardown
from torchherd.train.errors import (
    ConfigInvalid,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMismatch,
    TrainError,
)
from torchherd.train.loop import FitResult, LossFn, Trainer
from torchherd.train.metrics import PEAK_BF16_FLOPS, MetricsLogger
from torchherd.train.rng import get_rng_state, seed_everything, set_rng_state
from torchherd.train.snapshot import SnapshotProblem, Snapshotter

__all__ = [
    "ConfigInvalid",
    "Context",
    "FitResult",
    "LossFn",
    "MetricsLogger",
    "PEAK_BF16_FLOPS",
    "ResumableSampler",
    "SnapshotCorrupt",
    "SnapshotError",
    "SnapshotMismatch",
    "SnapshotProblem",
    "Snapshotter",
    "TrainError",
    "Trainer",
    "TrainerConfig",
    "get_rng_state",
    "parse_config",
    "seed_everything",
    "set_rng_state",
    "setup",
    "supervised",
    "teardown",
]
