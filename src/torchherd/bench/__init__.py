"""`herd bench`: what a cluster really delivers, measured through the paths a job uses.

    net        TCP throughput and latency of every pair, in rounds of disjoint pairs
    allreduce  all-reduce time, algbw and busbw per message size (a herd job, like nccl-tests)
    scaling    a reference model (or your script) on 1, 2, 4, ... N nodes
    report     all three as one HTML page plus JSON under ~/.herd/bench/<id>/

Each measurement is a typed result with ``to_dict()`` for --json; plots (matplotlib, the
``torchherd[bench]`` extra) are drawn only when asked for, by `bench.plots`.
"""
