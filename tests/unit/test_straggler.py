"""The slow-rank watch (recovery.straggler) on compute times and on looks at the ranks."""

from __future__ import annotations

import random

from torchherd.recovery.hang import RankLook
from torchherd.recovery.straggler import (
    CONFIRM,
    FEWEST,
    HOLDS,
    SAMPLES,
    StragglerWatch,
    slow_by_compute,
    slow_by_samples,
)


def test_a_rank_twice_as_slow_is_named_with_its_figures() -> None:
    rng = random.Random(1)
    times = {
        ("n1", 0): [0.100 + rng.uniform(-0.01, 0.01) for _ in range(20)],
        ("n1", 1): [0.105 + rng.uniform(-0.01, 0.01) for _ in range(20)],
        ("n2", 2): [0.210 + rng.uniform(-0.01, 0.01) for _ in range(20)],
    }
    slow = slow_by_compute(times)
    assert slow is not None and (slow.host, slow.rank) == ("n2", 2)
    assert slow.ratio is not None and 1.9 < slow.ratio < 2.2
    assert "slower than the median rank" in slow.detail and "ms of compute per step" in slow.detail


def test_a_rank_under_a_cpu_quota_is_named_though_most_of_its_passes_run_at_full_speed() -> None:
    # What a rank held to 30 % of a CPU by cgroup beat on the testbed: forward passes of 10 ms
    # inside its quota, about 78 ms when the quota ran out halfway (the median is 10 ms).
    throttled = [0.010, 0.078, 0.009, 0.010, 0.075, 0.011, 0.080, 0.010, 0.009, 0.077] * 2
    times = {("n1", 0): [0.010, 0.011, 0.009, 0.014, 0.010] * 4, ("n2", 1): throttled}
    slow = slow_by_compute(times)
    assert slow is not None and (slow.host, slow.rank) == ("n2", 1)
    assert slow.ratio is not None and slow.ratio > 2.5, slow.detail
    # One pause in twenty (a GC, a page fault) is not a slow rank.
    paused = [0.010] * 19 + [0.300]
    assert slow_by_compute({("n1", 0): [0.010] * 20, ("n2", 1): paused}) is None


def test_a_balanced_job_names_nobody() -> None:
    rng = random.Random(2)
    times = {("n", r): [0.1 * rng.uniform(0.8, 1.2) for _ in range(20)] for r in range(8)}
    assert slow_by_compute(times) is None


def test_tiny_differences_do_not_count() -> None:
    times = {("n", 0): [0.001] * 10, ("n", 1): [0.003] * 10}  # 3x, but 2 ms
    assert slow_by_compute(times) is None


def test_a_rank_is_named_once_and_only_after_checks_in_a_row() -> None:
    watch = StragglerWatch()
    found = []
    for _ in range(CONFIRM + 3):
        for _ in range(FEWEST):
            watch.computed("n1", 0, 0.1)
            watch.computed("n2", 1, 0.3)
        found.append(watch.check(world_size=2))
    named = [f for f in found if f is not None]
    assert len(named) == 1 and found.index(named[0]) == CONFIRM - 1
    assert (named[0].host, named[0].rank) == ("n2", 1)


def look(host: str, rank: int, frames: list[str], active: bool = False) -> RankLook:
    return RankLook(host, rank, 100 + rank, 0.0, "S", 0, 0, tuple(frames), active=active)


WAITS = ["all_reduce (torch/distributed/distributed_c10d.py:3252)", "<module> (train.py:9)"]
WORKS = ["matmul_loop (train.py:20)", "<module> (train.py:8)"]


def test_the_rank_that_keeps_the_others_waiting_is_named_from_looks() -> None:
    rounds = [[look("n1", 0, WAITS), look("n2", 1, WORKS, active=True)] for _ in range(SAMPLES)]
    slow = slow_by_samples(rounds)
    assert slow is not None and (slow.host, slow.rank) == ("n2", 1)
    assert f"held the others up in {SAMPLES} of {SAMPLES} looks" in slow.detail
    assert "all_reduce" in slow.detail


def test_looks_of_a_balanced_job_name_nobody() -> None:
    rounds = []
    for index in range(SAMPLES):
        a, b = (WAITS, WORKS) if index % 2 else (WORKS, WAITS)
        rounds.append([look("n1", 0, a), look("n2", 1, b)])
    assert slow_by_samples(rounds) is None
    few = [[look("n1", 0, WAITS), look("n2", 1, WORKS)] for _ in range(HOLDS - 1)]
    assert slow_by_samples(few) is None  # not enough looks yet
