"""Benchmark: torchherd.train.Trainer against a hand-written DDP loop (same model, data, steps).

    python bench/trainer_overhead.py [--blocks 16] [--steps 20]

Starts one `torchrun --standalone --nproc-per-node 2` job on CPU/Gloo. Inside it both loops
are built and warmed up, then run in interleaved blocks of steps (order alternating), each
timed between two barriers, so that a slowdown of the shared machine hits both alike.
Run twice: with the Trainer's defaults (TensorBoard on), and also logging to MLflow (a real
tracking server started here) through a proxy that answers every request after 500 ms.
Prints ratio = median trainer block / median hand-written block (target <= 1.02), and for
reference the ratio of total times and the median of per-pair ratios. On a shared 2-core
machine these move by a few percent between runs, so it also measures the Trainer's own cost
per step directly: both loops on a tiny model in one process, where that cost is not hidden
by compute, and reports it as a share of the big model's step. The model is an MLP of
~3.4M parameters, so the per-step framework cost is measured against real compute and a real
13 MB gradient all-reduce, not against nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.02
WIDTH, DEPTH, FEATURES, BATCH, WARMUP = 1024, 4, 256, 64, 5


def _build() -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4096, FEATURES, generator=generator)
    data = TensorDataset(inputs, inputs[:, :1].sin())
    return model, data


class Handwritten:
    """The loop every DDP tutorial teaches, able to run a given number of steps at a time."""

    def __init__(self) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        model, data = _build()
        self.model = DistributedDataParallel(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sampler = DistributedSampler(data, shuffle=True, seed=0)
        self.loader = DataLoader(data, batch_size=BATCH, sampler=self.sampler)
        self.batches = self._forever()

    def _forever(self) -> Iterator[Any]:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def run(self, steps: int, done: int) -> None:
        import torch.distributed as dist
        from torch.nn import functional as F

        for step in range(done + 1, done + steps + 1):
            inputs, targets = next(self.batches)
            loss = F.mse_loss(self.model(inputs), targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if step % 10 == 0 and dist.get_rank() == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)


class WithTrainer:
    """The same training through Trainer.fit(), continued ``steps`` at a time."""

    def __init__(self, run_dir: str) -> None:
        import torch
        from torch import nn

        from torchherd import train

        model, data = _build()
        config = train.TrainerConfig(
            run_dir=run_dir,
            max_steps=0,
            batch_size=BATCH,
            resume=False,
            trackers=os.environ.get("BENCH_TRACKERS", ""),  # TensorBoard on: the default
        )
        self.trainer = train.Trainer(
            model,
            lambda params: torch.optim.AdamW(params, lr=1e-3),
            data,
            train.supervised(nn.functional.mse_loss),
            config,
        )

    def run(self, steps: int, done: int) -> None:
        self.trainer.config.max_steps = done + steps
        self.trainer.fit()


def _timed(loop: Any, steps: int, done: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    loop.run(steps, done)
    dist.barrier()
    return time.perf_counter() - started


def worker(blocks: int, steps: int) -> None:
    from torchherd import train

    ctx = train.setup()
    times: dict[str, list[float]] = {"trainer": [], "handwritten": []}
    with tempfile.TemporaryDirectory() as scratch:
        loops = {"handwritten": Handwritten(), "trainer": WithTrainer(scratch)}
        for loop in loops.values():
            loop.run(WARMUP, 0)
        # Interleaved blocks: a slowdown of the (shared) machine hits both loops alike.
        for index in range(blocks):
            order = ["handwritten", "trainer"] if index % 2 == 0 else ["trainer", "handwritten"]
            for kind in order:
                times[kind].append(_timed(loops[kind], steps, WARMUP + index * steps))
        loops["trainer"].trainer.close()
    if ctx.is_main:
        print("RESULT " + json.dumps(times), flush=True)
    train.teardown()


def per_step_overhead(steps: int = 1500, repeats: int = 5) -> tuple[float, float]:
    """Seconds per step of a hand-written loop and of the Trainer on a tiny model in this one
    process: with almost no compute, the difference is the Trainer's own per-step cost."""
    import contextlib
    import io

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from torchherd import train

    data = TensorDataset(torch.randn(steps * 4, 8), torch.randn(steps * 4, 1))

    def hand() -> float:
        model = nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = iter(DataLoader(data, batch_size=4, sampler=RandomSampler(data)))
        started = time.perf_counter()
        for step in range(steps):
            inputs, targets = next(batches)
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                loss.item()
        return time.perf_counter() - started

    def trainer() -> float:
        with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
            config = train.TrainerConfig(
                run_dir=scratch, max_steps=steps, batch_size=4, resume=False
            )
            fit = train.Trainer(
                nn.Linear(8, 1),
                lambda params: torch.optim.SGD(params, lr=0.01),
                data,
                train.supervised(nn.functional.mse_loss),
                config,
            )
            started = time.perf_counter()
            fit.fit()
            elapsed = time.perf_counter() - started
            fit.close()
        return elapsed

    hand_times, trainer_times = [], []
    for _ in range(repeats):  # interleaved; the minimum is the run least disturbed by others
        hand_times.append(hand())
        trainer_times.append(trainer())
    return min(hand_times) / steps, min(trainer_times) / steps


def run_job(blocks: int, steps: int, env: dict[str, str]) -> dict[str, list[float]] | None:
    """One torchrun job of both loops; the timed blocks, or None (its output printed)."""
    argv_ = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv_ += [__file__, "--worker", "--blocks", str(blocks), "--steps", str(steps)]
    done = subprocess.run(argv_, env=env, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        return None
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def report(title: str, times: dict[str, list[float]], steps: int) -> bool:
    trainer, hand = times["trainer"], times["handwritten"]
    ratio = statistics.median(trainer) / statistics.median(hand)
    paired = statistics.median(t / h for t, h in zip(trainer, hand, strict=True))
    print(f"{title}:")
    for name, values in (("handwritten DDP", hand), ("Trainer", trainer)):
        print(
            f"  {name:16} median block {statistics.median(values):.3f}s, total {sum(values):.2f}s"
        )
    print(
        f"  also: ratio of totals {sum(trainer) / sum(hand):.3f}, median paired ratio {paired:.3f}"
    )
    met = ratio <= TARGET
    print(
        f"  ratio = trainer_time / handwritten_time = {ratio:.3f} (medians); "
        f"target <= {TARGET}: {'met' if met else 'not met'}"
    )
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks of each loop")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--tracker-delay", type=float, default=0.5, help="seconds per answer")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.blocks, args.steps)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    params = (FEATURES + 1) * WIDTH + (DEPTH - 1) * (WIDTH + 1) * WIDTH + WIDTH + 1
    print(f"model: MLP {params / 1e6:.1f}M params, batch {BATCH}/rank, 2 ranks, CPU/Gloo")
    print(f"{args.blocks} interleaved blocks of {args.steps} steps each")
    results = []
    times = run_job(args.blocks, args.steps, env)
    if times is None:
        return 1
    per_step = statistics.median(times["handwritten"]) / args.steps
    print(f"{per_step * 1e3:.0f} ms/step (hand-written)")
    results.append(report("Trainer defaults (TensorBoard on)", times, args.steps))
    slow = slow_tracker_job(args, env)
    if slow is not None:
        results.append(slow)
    hand_step, trainer_step = per_step_overhead()
    extra = trainer_step - hand_step
    print(
        f"per-step cost of the Trainer itself (tiny model, 1 process): {extra * 1e6:.0f} us "
        f"= {extra / per_step * 100:.2f}% of a step of the model above"
    )
    verdict = "all met" if all(results) else "not all met"
    print(f"targets: {verdict}; wall {time.perf_counter() - started:.0f}s")
    return 0


def slow_tracker_job(args: argparse.Namespace, env: dict[str, str]) -> bool | None:
    """The same job logging to MLflow (a real tracking server, started here) through a
    proxy that answers every request after ``--tracker-delay`` seconds."""
    sys.path.insert(0, str(REPO))
    try:
        from tests.trackserver import FaultyProxy, mlflow_server
    except ImportError as exc:
        print(f"slow tracker: skipped ({exc}; pip install -e '.[dev]')")
        return None
    with tempfile.TemporaryDirectory() as scratch, mlflow_server(Path(scratch)) as backend:
        proxy = FaultyProxy(backend, delay=args.tracker_delay)
        try:
            tracked = dict(env, BENCH_TRACKERS="mlflow", MLFLOW_TRACKING_URI=proxy.url)
            times = run_job(args.blocks, args.steps, tracked)
        finally:
            proxy.close()
        if times is None:
            return False
        title = (
            f"TensorBoard and MLflow answering after {args.tracker_delay * 1e3:.0f} ms "
            f"({proxy.answered} requests answered)"
        )
        return report(title, times, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
