"""Test job: every rank prints where it runs: its host, its Slurm job step (if any), and what
the node's setup prelude exported (FROM_SETUP)."""

import os
import socket

print(
    f"WHERE rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
    f"host={socket.gethostname()} step={os.environ.get('SLURM_STEP_ID', '-')} "
    f"step_tasks={os.environ.get('SLURM_STEP_NUM_TASKS', '-')} "
    f"step_nodes={os.environ.get('SLURM_STEP_NUM_NODES', '-')} "
    f"setup={os.environ.get('FROM_SETUP', '-')}",
    flush=True,
)
