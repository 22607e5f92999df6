"""Test job: every rank prints the CPU threads it was given and the cores it may use."""

import os

import torch

print(
    f"THREADS rank={os.environ['RANK']} local_world={os.environ['LOCAL_WORLD_SIZE']} "
    f"omp={os.environ.get('OMP_NUM_THREADS')} torch={torch.get_num_threads()} "
    f"cores={len(os.sched_getaffinity(0))}",
    flush=True,
)
