"""The Trainer's configuration, and the one function that turns a command line into configs.

Every field carries a one-line docstring under it; ``parse_config`` reads those docstrings from
the source so they become the ``--help`` text, and turns ``max_steps`` into ``--max-steps``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from torchherd.train.errors import ConfigInvalid
from torchherd.train.trackers import parse_trackers

__all__ = ["TrainerConfig", "parse_config", "field_docs"]

Parallel = Literal["auto", "ddp", "fsdp", "none"]
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """How a ``Trainer`` runs: length, batching, precision, snapshots and logging."""

    run_dir: str = "runs/default"
    """Folder or URL (s3://bucket/prefix) for metrics.jsonl, TensorBoard events, snapshots."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (counting those before a resume)."""
    max_epochs: int | None = None
    """Stop after this many passes over the data; one of max_steps/max_epochs is needed."""
    batch_size: int = 32
    """Samples per micro-batch on each rank."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed before each optimizer step."""
    parallel: Parallel = "auto"
    """Wrap the model in DDP, FSDP (fully_shard) or nothing; auto is DDP when world > 1."""
    precision: Precision = "fp32"
    """Autocast dtype: fp32 (none), bf16, or fp16 with a gradient scaler."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value (None: no clipping)."""
    eval_every: int = 0
    """Evaluate on the eval dataset every N steps (0: only at the end, if one is given)."""
    snapshot_every: int = 0
    """Save a snapshot every N steps (0: not by step count)."""
    snapshot_every_seconds: float = 0.0
    """Also save when this many seconds passed since the last one (checked at log steps)."""
    snapshot_dir: str | None = None
    """Folder or URL for snapshots; default <run_dir>/snapshots (local disk for scope node)."""
    snapshot_keep: int = 3
    """How many snapshots to keep; older ones are deleted after each save."""
    snapshot_scope: Literal["shared", "node"] = "shared"
    """shared: one copy by rank 0 on a shared filesystem; node: one copy per node."""
    snapshot_async: bool = True
    """Write snapshots in the background (training waits only for a copy to host memory)."""
    resume: bool = True
    """Continue from the latest snapshot when one exists."""
    log_every: int = 10
    """Print a progress line (rank 0) and flush metrics every N steps."""
    seed: int = 0
    """Seed for the data order and for every random generator at the start."""
    shuffle: bool = True
    """Shuffle the training data (a new order every epoch)."""
    drop_last: bool = False
    """Drop the incomplete tail of each epoch instead of padding it."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    persistent_workers: bool = False
    """Keep the DataLoader worker processes from one epoch to the next (with num_workers >
    0): forked once, not at every epoch's start (short epochs stop paying a fork and the
    workers' start each time). They then keep their own copy of the dataset: changes the
    training process makes to it between epochs do not reach them."""
    gc_freeze: bool = True
    """Freeze what the model, optimizer and compiled code hold after the first step, so
    Python's garbage collector stops walking it (its pauses stay short)."""
    tensorboard: bool = True
    """Write TensorBoard events when the tensorboard package is installed."""
    trackers: str = ""
    """Experiment trackers, comma-separated: wandb, mlflow (rank 0; keys from the environment)."""
    tracker_project: str = "torchherd"
    """W&B project / MLflow experiment that the job's run goes to."""
    upload_every: float = 30.0
    """Seconds between uploads of metrics and TensorBoard files to a URL run_dir (background)."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_steps is None and self.max_epochs is None:
            problems.append("set max_steps or max_epochs (the run needs an end)")
        for name in ("max_steps", "max_epochs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{name} must be >= 0, got {value}")
        for name in ("batch_size", "grad_accum_steps", "log_every", "snapshot_keep"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "snapshot_every", "snapshot_every_seconds", "num_workers"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.upload_every <= 0:
            problems.append(f"upload_every must be > 0, got {self.upload_every}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            problems.append(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        for name, allowed in (
            ("parallel", typing.get_args(Parallel)),
            ("precision", typing.get_args(Precision)),
            ("snapshot_scope", ("shared", "node")),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)}")
        try:
            parse_trackers(self.trackers)
        except ConfigInvalid as exc:
            problems.append(f"trackers: {exc.message}")
        if problems:
            raise ConfigInvalid("invalid TrainerConfig: " + "; ".join(problems))

    @property
    def snapshots_enabled(self) -> bool:
        """True when snapshots are saved at all (by step count or by time)."""
        return self.snapshot_every > 0 or self.snapshot_every_seconds > 0


# ---------------------------------------------------------------------------- command line


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source code."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value.strip()
    return docs


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_field(
    parser: argparse._ActionsContainer, name: str, hint: Any, default: Any, doc: str
) -> None:
    flag = "--" + name.replace("_", "-")
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = len(args) < len(typing.get_args(hint)), args[0]
    # argparse %-formats help text; the formatter appends "(default: ...)" itself.
    kwargs: dict[str, Any] = {"default": default, "help": doc.replace("%", "%%")}
    if typing.get_origin(hint) is Literal:
        kwargs["choices"] = list(typing.get_args(hint))
    elif hint is bool:
        kwargs.update(type=_bool, metavar="BOOL")
    elif hint in (int, float, str):
        base = hint
        kwargs["type"] = (lambda s: None if s.lower() == "none" else base(s)) if optional else base
        kwargs["metavar"] = name.upper()
    else:
        raise ConfigInvalid(f"field {name} has a type the command line cannot parse: {hint}")
    parser.add_argument(flag, dest=name, **kwargs)


def parse_config(
    *classes: type[Any],
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    description: str | None = None,
) -> tuple[Any, ...]:
    """Parse ``argv`` into one instance of each dataclass in ``classes``, in order.

    ``defaults`` overrides the dataclass defaults by field name (an example's own defaults).
    A field name must belong to one class only. Invalid values exit with argparse's message.
    """
    defaults = dict(defaults or {})
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    owners: dict[str, type] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        group = parser.add_argument_group(cls.__name__)
        for item in dataclasses.fields(cls):
            if item.name in owners:
                raise ConfigInvalid(f"field {item.name} is in both {owners[item.name]} and {cls}")
            owners[item.name] = cls
            if item.name in defaults:
                default = defaults.pop(item.name)
            elif item.default is not dataclasses.MISSING:
                default = item.default
            elif item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = None
            _add_field(group, item.name, hints[item.name], default, docs.get(item.name, ""))
    if defaults:
        raise ConfigInvalid(f"defaults for unknown fields: {', '.join(sorted(defaults))}")
    namespace = vars(parser.parse_args(argv))
    built = []
    for cls in classes:
        values = {f.name: namespace[f.name] for f in dataclasses.fields(cls)}
        try:
            built.append(cls(**values))
        except ConfigInvalid as exc:
            parser.error(str(exc))
    return tuple(built)
