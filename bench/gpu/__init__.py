"""The GPU check: `scripts/gpu-check` proves herd's GPU path on a machine with NVIDIA GPUs.

One command, no arguments needed, no internet: it runs tests/gpu (doctor against nvidia-smi,
one worker per GPU, NCCL through `herd launch`, CUDA errors and out-of-memory in words, the
flight-recorder variables, a hang in a CUDA kernel), examples/gpt.py at GPT-2-small size in bf16
with and without torch.compile next to a hand-written loop, snapshots of a 4 GB GPU state
against PyTorch DCP's async_save, and `herd bench allreduce` on the GPUs; then it writes one JSON
report and prints a table. What cannot run on the machine at hand is reported as "not run: why".
On a machine without a GPU it says so in one line and exits 0.

Modules: ``check`` (the command), ``report`` (rows, JSON, table), ``smi`` (nvidia-smi facts and
their comparison with herd's probe), ``machine`` (what torch offers here), ``launching`` (`herd
launch` with a private HERD_HOME, verdicts from the job record), one module per part (``tests``,
``gpt``, ``snapshot``, ``allreduce``) and the programs those parts start on the GPU
(``gpt_hand``, ``snapshot_worker``, ``copy_worker``).
"""
