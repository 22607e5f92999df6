"""Errors raised inside training scripts, each with a message for people and a remedy line.

They extend the launcher's ``HerdError`` tree so that ``herd launch`` can print a worker's
failure the same way it prints its own: what went wrong, then what to do about it.
"""

from __future__ import annotations

from torchherd.errors import HerdError


class TrainError(HerdError):
    """Base class for errors raised by ``torchherd.train``."""


class SnapshotError(TrainError):
    """A snapshot directory cannot be used at all (not shared where it must be, unwritable)."""


class SnapshotCorrupt(SnapshotError):
    """Every snapshot found is damaged or unsafe; ``problems`` names each one and why."""

    def __init__(self, message: str, remedy: str = "", problems: tuple[str, ...] = ()) -> None:
        super().__init__(message, remedy)
        self.problems = problems


class SnapshotMismatch(SnapshotError):
    """A snapshot was written by a different model: keys or shapes differ.

    ``missing`` are keys the model has and the snapshot lacks, ``unexpected`` the reverse,
    ``shape_differences`` maps a key to ``(shape in snapshot, shape in model)``.
    """

    def __init__(
        self,
        message: str,
        remedy: str = "",
        *,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
        shape_differences: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        super().__init__(message, remedy)
        self.missing = missing
        self.unexpected = unexpected
        self.shape_differences = dict(shape_differences or {})


class ConfigInvalid(TrainError):
    """A ``TrainerConfig`` value is impossible (negative steps, unknown precision, ...)."""
