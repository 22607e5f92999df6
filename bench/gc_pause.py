"""Benchmark: Python's garbage-collection pauses in the Trainer after torch.compile, with and
without freezing the heap (TrainerConfig.gc_freeze).

    python bench/gc_pause.py [--steps 80] [--at 40]

A full collection walks every object the interpreter tracks, and torch.compile leaves a great
many (dynamo's and inductor's caches): on an H200 the compiled examples/gpt.py paused 0.29-0.37 s
in such passes, each at a moment its rank chose alone. Here, on CPU, examples/gpt.py's model
(4 blocks, 128 wide, 128 characters of context) is compiled block by block (inductor needs a C++
compiler) and trained by the Trainer, once with gc_freeze off and once on, each in a fresh
interpreter with inductor's caches off (both compile alike). In each, at step --at the loss
function times one full collection: what a pass the interpreter starts by itself costs at that
moment. Every collection the interpreter ran by itself during the steps after the first is
recorded too (gc.callbacks), with its generation and length.

Prints both runs' full pass, the longest pause the interpreter chose itself and the objects it
walks, then ratio = full pass (frozen) / full pass (not frozen) against the target (<= 0.1),
met / not met.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.1
MARKER = "GC_PAUSE "


def child(freeze: bool, steps: int, at: int) -> dict[str, Any]:
    """Train with the Trainer in this process; what its collections cost."""
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    import gpt  # examples/gpt.py

    from torchherd import train

    shape = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
    gpt_config = gpt.GPTConfig(compile=True, dropout=0.0, **shape)  # type: ignore[arg-type]
    run_dir = tempfile.mkdtemp(prefix="herd-gc-pause-")
    config = train.TrainerConfig(
        run_dir=run_dir,
        max_steps=steps,
        batch_size=8,
        log_every=10,
        resume=False,
        tensorboard=False,
        gc_freeze=freeze,
    )
    ctx = train.setup()
    train.seed_everything(config.seed)
    alphabet, ids, split = gpt.encode(gpt_config)
    model = gpt.build_model(gpt_config, len(alphabet))
    found: dict[str, Any] = {"pauses": []}
    started: dict[int, float] = {}
    calls = 0

    def record(phase: str, info: dict[str, Any]) -> None:
        generation = int(info.get("generation", 0))
        if phase == "start":
            started[generation] = time.perf_counter()
        elif calls > 1 and generation in started:  # after the first step (compiled by then)
            found["pauses"].append([generation, time.perf_counter() - started[generation]])

    def loss(model: Any, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == at:
            gc.callbacks.remove(record)  # the pass timed here is not one the interpreter chose
            found["tracked"] = len(gc.get_objects())
            found["frozen"] = gc.get_freeze_count()
            began = time.perf_counter()
            gc.collect()
            found["full_pass_s"] = time.perf_counter() - began
            gc.callbacks.append(record)
        return gpt.language_model_loss(model, batch)

    trainer = train.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=gpt_config.lr),
        gpt.CharWindows(ids[:split], gpt_config.block_size),
        loss,
        config,
        ctx=ctx,
    )
    gc.callbacks.append(record)
    try:
        with trainer:
            trainer.fit()
    finally:
        gc.callbacks.remove(record)
        train.teardown()
    pauses = [seconds for _, seconds in found["pauses"]]
    found["longest_s"] = max(pauses, default=0.0)
    found["passes"] = len(pauses)
    return found


def run_child(freeze: bool, steps: int, at: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    # Both runs compile alike: no cached graphs from the run before.
    env |= {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    env |= {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")}
    argv = [sys.executable, __file__, "--child", "--freeze", str(int(freeze))]
    argv += ["--steps", str(steps), "--at", str(at)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            return dict(json.loads(line[len(MARKER) :]))
    raise SystemExit(
        f"the run with gc_freeze={freeze} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=80, help="training steps per run")
    parser.add_argument("--at", type=int, default=40, help="the step whose full pass is timed")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--freeze", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 < args.at < args.steps:
        parser.error("--at must be between 2 and --steps - 1")
    if args.child:
        print(MARKER + json.dumps(child(bool(args.freeze), args.steps, args.at)), flush=True)
        return 0
    results = {}
    for freeze in (False, True):
        print(f"gc_freeze={str(freeze).lower()}: compiling and training {args.steps} steps ...")
        results[freeze] = found = run_child(freeze, args.steps, args.at)
        print(
            f"  full pass at step {args.at}: {found['full_pass_s'] * 1000:.1f} ms "
            f"({found['tracked']:,} objects walked, {found['frozen']:,} frozen); "
            f"the interpreter's own passes: {found['passes']}, longest "
            f"{found['longest_s'] * 1000:.1f} ms"
        )
    ratio = results[True]["full_pass_s"] / results[False]["full_pass_s"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"ratio = full pass frozen / not frozen = {ratio:.3f} (<= {TARGET}): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
