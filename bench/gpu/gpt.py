"""Part 2 of the GPU check: examples/gpt.py at GPT-2-small size in bf16, eager and compiled,
next to the same model trained by a hand-written loop (bench/gpu/gpt_hand.py).

Both run through `herd launch` with one worker per GPU, the same options and the same number
of steps. The Trainer's throughput is read from its own metrics.jsonl (the windows after the
warm-up steps); the hand-written loop times the same steps itself. Rows per setting:
  - tokens/s and MFU of each; on an H100 the compiled Trainer's MFU has the target >= 40 %;
  - the Trainer's overhead: hand-written tokens/s / Trainer tokens/s (target <= 1.02);
  - the MFU figure in metrics.jsonl against MFU computed here from its tokens/s, the model's
    FLOPs and the GPU's peak (they must agree within 2 %).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchherd.bench.job import read_answer

from .launching import REPO, launch
from .machine import TorchFeatures
from .report import Row, Target, failed, measured, not_run, passed

PART = "gpt"
MARKER = "HERD_GPU_HAND "
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
MFU_TARGET = Target(">=", 0.40)
MFU_TARGET_GPU = "H100"
OVERHEAD_TARGET = Target("<=", 1.02)
MFU_AGREEMENT = 0.02


@dataclass(frozen=True)
class GptSettings:
    steps: int = 80
    """Optimizer steps per run."""
    warmup: int = 30
    """Steps left out of the timing (compilation, warm-up); a multiple of log_every."""
    batch_size: int = 16
    """Sequences per GPU per step."""
    log_every: int = 10
    size: Mapping[str, int] = field(default_factory=lambda: dict(GPT2_SMALL))
    """The model's shape: GPT-2 small unless a test asks for less."""


def common_args(settings: GptSettings, compiled: bool) -> list[str]:
    """The options examples/gpt.py and the hand-written loop both get."""
    args = [
        "--max-steps", str(settings.steps),
        "--batch-size", str(settings.batch_size),
        "--precision", "bf16",
        "--dropout", "0",
        "--max-grad-norm", "1.0",
        "--log-every", str(settings.log_every),
        "--compile", "true" if compiled else "false",
    ]  # fmt: skip
    for name, value in settings.size.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def trainer_argv(settings: GptSettings, compiled: bool, run_dir: Path) -> list[str]:
    return [
        "examples/gpt.py",
        *common_args(settings, compiled),
        "--run-dir", str(run_dir),
        "--resume", "false",
        "--snapshot-every", "0",
        "--eval-every", "0",
        "--tensorboard", "false",
    ]  # fmt: skip


def hand_argv(settings: GptSettings, compiled: bool) -> list[str]:
    return [
        "bench/gpu/gpt_hand.py",
        *common_args(settings, compiled),
        "--warmup-steps", str(settings.warmup),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ arithmetic


def steady(records: Sequence[Mapping[str, Any]], after_step: int, key: str) -> float | None:
    """The rate over the logged windows after ``after_step``: windows hold the same number of
    steps, so total work over total time is the harmonic mean of their rates."""
    values = [float(r[key]) for r in records if r.get(key) and int(r["step"]) > after_step]
    if not values or any(v <= 0 for v in values):
        return None
    return len(values) / sum(1 / v for v in values)


def mfu(
    tokens_per_s: float, flops_per_sample: float, tokens_per_sample: int, peak: float, world: int
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of every GPU of the job."""
    return tokens_per_s / tokens_per_sample * flops_per_sample / (peak * world)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            records.append(record)
    return records


def _figures(tokens: float, share: float | None) -> str:
    return f"{tokens:,.0f} tokens/s" + (f", MFU {share:.1%}" if share is not None else "")


def setting_rows(
    label: str,
    records: Sequence[Mapping[str, Any]],
    hand: Mapping[str, Any],
    settings: GptSettings,
) -> list[Row]:
    """The rows of one setting (eager or compiled) from the Trainer's metrics records and the
    hand-written loop's answer (both runs finished)."""
    rows: list[Row] = []
    trainer_tokens = steady(records, settings.warmup, "tokens_per_s")
    if trainer_tokens is None:
        return [failed(PART, f"examples/gpt.py, {label}", "metrics.jsonl has no tokens/s")]
    world = int(hand["world_size"])
    peak = hand.get("peak_flops")

    def share(tokens: float) -> float | None:
        if not peak:
            return None
        return mfu(tokens, hand["flops_per_sample"], hand["tokens_per_sample"], peak, world)

    device = str(hand.get("device", ""))
    trainer_mfu = share(trainer_tokens)
    on_target_gpu = MFU_TARGET_GPU in device and label == "compiled"
    trainer_value = trainer_mfu if trainer_mfu is not None else trainer_tokens
    rows.append(
        measured(
            PART,
            f"examples/gpt.py (Trainer), {label}",
            trainer_value,
            _figures(trainer_tokens, trainer_mfu) + f" on {world} x {device}",
            MFU_TARGET if on_target_gpu and trainer_mfu is not None else None,
            tokens_per_s=trainer_tokens,
            mfu=trainer_mfu,
        )
    )
    hand_tokens = float(hand["tokens_per_s"])
    hand_mfu = share(hand_tokens)
    rows.append(
        measured(
            PART,
            f"hand-written loop, {label}",
            hand_mfu if hand_mfu is not None else hand_tokens,
            _figures(hand_tokens, hand_mfu),
            tokens_per_s=hand_tokens,
            mfu=hand_mfu,
        )
    )
    ratio = hand_tokens / trainer_tokens
    rows.append(
        measured(
            PART,
            f"Trainer overhead, {label}",
            ratio,
            f"ratio = hand-written tokens/s / Trainer tokens/s = {ratio:.3f}",
            OVERHEAD_TARGET,
        )
    )
    rows.append(mfu_agreement(label, records, settings.warmup, trainer_mfu, device))
    return rows


def mfu_agreement(
    label: str,
    records: Sequence[Mapping[str, Any]],
    warmup: int,
    expected: float | None,
    device: str,
) -> Row:
    """The Trainer's MFU figure against MFU computed from its own tokens/s."""
    name = f"MFU in metrics.jsonl, {label}"
    logged = steady(records, warmup, "mfu")
    if expected is None:
        if logged is None:
            return not_run(PART, name, f"no peak FLOP/s known for {device or 'this GPU'}")
        return failed(PART, name, f"metrics say MFU {logged:.1%} for a GPU without a known peak")
    if logged is None:
        return failed(PART, name, f"metrics.jsonl has no MFU although {device}'s peak is known")
    if abs(logged - expected) > MFU_AGREEMENT * expected:
        return failed(PART, name, f"metrics say {logged:.2%}, tokens/s x FLOPs give {expected:.2%}")
    return passed(PART, name, f"{logged:.2%} (computed {expected:.2%})")


# ------------------------------------------------------------------------------ running


def run_gpt(out_dir: Path, torch: TorchFeatures, settings: GptSettings | None = None) -> list[Row]:
    """Both settings, Trainer then hand-written loop; what cannot run says why."""
    settings = settings or GptSettings()
    rows: list[Row] = []
    for label, compiled in (("eager", False), ("compiled", True)):
        why = torch.compile_on_gpu if compiled else None
        if why:
            rows.append(not_run(PART, f"examples/gpt.py and hand-written loop, {label}", why))
            continue
        rows += run_setting(out_dir / f"gpt-{label}", label, compiled, settings)
    return rows


def run_setting(where: Path, label: str, compiled: bool, settings: GptSettings) -> list[Row]:
    run_dir = where / "run"
    trainer, job = launch(
        trainer_argv(settings, compiled, run_dir),
        home=where / "home-trainer",
        cwd=REPO,
        timeout=600,
    )
    if job is None or not job.succeeded:
        how = job.describe() if job else f"exit {trainer.returncode}, no job record"
        return [failed(PART, f"examples/gpt.py, {label}", f"{how}: {trainer.tail(3)}")]
    hand_run, hand_job = launch(
        hand_argv(settings, compiled), home=where / "home-hand", cwd=REPO, timeout=600
    )
    hand = read_answer(hand_run.stdout, MARKER)
    if hand_job is None or not hand_job.succeeded or hand is None:
        how = hand_job.describe() if hand_job else f"exit {hand_run.returncode}"
        return [failed(PART, f"hand-written loop, {label}", f"{how}: {hand_run.tail(3)}")]
    return setting_rows(label, read_metrics(run_dir), hand, settings)
