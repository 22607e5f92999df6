"""The slow-rank watch (recovery.straggler) on waits, on compute times and on looks at the
ranks: tables of cases, balanced jobs among them."""

from __future__ import annotations

import random

import pytest

from torchherd.recovery.hang import RankLook
from torchherd.recovery.straggler import (
    CONFIRM,
    CONFIRM_WAIT,
    FEWEST,
    FEWEST_WAITS,
    HOLDS,
    SAMPLES,
    WAIT_WINDOW,
    WARMUP,
    StepTiming,
    StragglerWatch,
    slow_by_compute,
    slow_by_samples,
    slow_by_waits,
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


# ------------------------------------------------ waits: the rank everyone waits for waits least


def beats(
    wait_ms: float,
    cycle_ms: float,
    data_ms: float = 2.0,
    spread: float = 0.15,
    seed: int = 0,
    count: int = WAIT_WINDOW,
) -> list[StepTiming]:
    """A rank's beats: mean wait, step and data time per step, each beat off by up to
    ``spread`` of the wait (what a shared machine does to a balanced job)."""
    rng = random.Random(seed)
    return [
        StepTiming(
            max(0.0, wait_ms * (1 + rng.uniform(-spread, spread))) / 1000,
            cycle_ms * (1 + rng.uniform(-0.05, 0.05)) / 1000,
            data_ms / 1000,
        )
        for _ in range(count)
    ]


# Beats a balanced two-rank Trainer job on one CPU each wrote (the all-reduce of 9 MB of
# gradients takes about 25 ms of a 100 ms step on both): wait, step, data.
BALANCED = [
    (0.0338, 0.0965, 0.0016),
    (0.0374, 0.1163, 0.0039),
    (0.0248, 0.0948, 0.0032),
    (0.0271, 0.1170, 0.0065),
    (0.0292, 0.1114, 0.0024),
]
BALANCED_TOO = [
    (0.0260, 0.0949, 0.0009),
    (0.0297, 0.1155, 0.0065),
    (0.0241, 0.0939, 0.0055),
    (0.0617, 0.1317, 0.0011),
    (0.0324, 0.1120, 0.0009),
]

WAIT_CASES = [
    # (name, {rank: beats}, named rank or None, what the line says)
    (
        "balanced, as recorded",
        {0: [StepTiming(*b) for b in BALANCED * 4], 1: [StepTiming(*b) for b in BALANCED_TOO * 4]},
        None,
        (),
    ),
    (
        "balanced, eight ranks",
        {r: beats(25, 100, seed=r) for r in range(8)},
        None,
        (),
    ),
    # 1.2x: 75 ms of work against the others' 62.5 ms; they wait 12.5 ms more for it.
    ("1.2x of two", {0: beats(37.5, 100, seed=1), 1: beats(25, 100, seed=2)}, 1, (1.1, 1.3)),
    (
        "1.2x of four",
        {
            0: beats(38, 100, seed=1),
            1: beats(25, 100, seed=2),
            2: beats(37, 100, seed=3),
            3: beats(38, 100, seed=4),
        },
        1,
        (1.1, 1.3),
    ),
    ("3x", {0: beats(100, 150, seed=1), 1: beats(0, 150, seed=2)}, 1, (2.7, 3.3)),
    ("1.05x: not enough", {0: beats(29, 100, seed=1), 1: beats(25, 100, seed=2)}, None, ()),
    ("too few beats yet", {0: beats(40, 100, count=5), 1: beats(20, 100, count=5)}, None, ()),
    ("a difference of 2 ms", {0: beats(3, 8, seed=1), 1: beats(1, 8, seed=2)}, None, ()),
]


@pytest.mark.parametrize(
    "by_rank, named, ratio", [c[1:] for c in WAIT_CASES], ids=[c[0] for c in WAIT_CASES]
)
def test_the_rank_that_waits_least_is_named_when_the_others_wait_for_it(
    by_rank: dict[int, list[StepTiming]], named: int | None, ratio: tuple[float, float]
) -> None:
    found = slow_by_waits({("n", r): b for r, b in by_rank.items()})
    if named is None:
        assert found is None, found
        return
    assert found is not None and found.rank == named
    assert found.ratio is not None and ratio[0] <= found.ratio <= ratio[1], found.detail
    assert f"is {found.ratio:.2f}x slower" in found.detail, found.detail
    assert "the others wait" in found.detail, found.detail
    assert found.causes == ()  # its data loader kept it no longer than the others


def test_a_data_loader_that_keeps_the_rank_waiting_is_named_as_the_cause() -> None:
    found = slow_by_waits(
        {("n1", 0): beats(40, 100, data_ms=2), ("n2", 1): beats(25, 100, data_ms=16)}
    )
    assert found is not None and found.rank == 1
    assert found.causes and found.causes[0].startswith("its data loader: it waited 16 ms")


def test_a_data_loader_whose_worker_also_takes_the_ranks_cpu_is_named_as_the_cause() -> None:
    # As a CI run saw it: the others wait 107 ms of a 490 ms step, 47 ms of which the slow
    # rank waited for batches; the rest its loader's worker took from the rank's own CPU.
    found = slow_by_waits(
        {("n1", 0): beats(140, 490, data_ms=7), ("n2", 1): beats(33, 490, data_ms=54)}
    )
    assert found is not None and found.rank == 1
    assert found.causes and found.causes[0].startswith("its data loader: it waited 54 ms")


def test_a_wait_for_batches_that_is_a_small_part_of_the_lag_names_no_cause() -> None:
    # 25 ms more waiting for batches against a 107 ms lag: something else holds the rank up.
    found = slow_by_waits(
        {("n1", 0): beats(140, 490, data_ms=7), ("n2", 1): beats(33, 490, data_ms=32)}
    )
    assert found is not None and found.rank == 1
    assert found.causes == (), found.causes


def test_waits_name_a_rank_only_past_the_warm_up_and_after_checks_in_a_row() -> None:
    watch = StragglerWatch()
    found = []
    slow, fast = beats(25, 100, count=200), beats(40, 100, count=200)
    for check in range(FEWEST_WAITS + CONFIRM_WAIT + 5):
        # The first beats of an attempt: the slow one looks fast (warm-up), and the judge
        # must not have them.
        watch.timed("n1", 0, fast[check] if check >= WARMUP else slow[check])
        watch.timed("n2", 1, slow[check] if check >= WARMUP else fast[check])
        found.append(watch.check(world_size=2))
    named = [(i, f) for i, f in enumerate(found) if f is not None]
    assert len(named) == 1, named
    index, first = named[0]
    assert (first.host, first.rank) == ("n2", 1)
    assert index == WARMUP + FEWEST_WAITS + CONFIRM_WAIT - 2  # not one check earlier


def test_one_long_step_among_balanced_ones_names_nobody() -> None:
    # A save or a collection on one rank: the others wait 400 ms once, in one beat.
    watch = StragglerWatch()
    one, other = beats(25, 100, seed=1, count=60), beats(25, 100, seed=2, count=60)
    other[30] = StepTiming(0.0, 0.5, 0.0)
    one[30] = StepTiming(0.4, 0.5, 0.0)
    for index in range(60):
        watch.timed("n1", 0, one[index])
        watch.timed("n2", 1, other[index])
        assert watch.check(world_size=2) is None


def test_a_node_forgotten_after_its_job_went_down_starts_a_new_warm_up() -> None:
    """Replica groups: a group that went down comes back with a new attempt, whose first
    beats must not be judged against what its last attempt reported."""
    watch = StragglerWatch()
    slow, fast = beats(25, 100, count=100), beats(40, 100, count=100)
    for check in range(WARMUP + FEWEST_WAITS):
        watch.timed("n1", 0, fast[check])
        watch.timed("n2", 0, slow[check])
    assert ("n2", 0) in watch.waits
    watch.forget(["n2"])
    assert ("n2", 0) not in watch.waits and ("n2", 0) not in watch.beats_seen
    assert ("n1", 0) in watch.waits  # the others keep theirs
    for check in range(WARMUP):  # its new attempt's warm-up is left out again
        watch.timed("n2", 0, slow[check])
    assert ("n2", 0) not in watch.waits


def test_a_named_rank_is_still_slow_only_while_the_checks_keep_finding_it() -> None:
    watch = StragglerWatch()
    slow, fast = beats(25, 100, count=200), beats(40, 100, count=200)
    for check in range(WARMUP + FEWEST_WAITS + CONFIRM_WAIT):
        watch.timed("n1", 0, fast[check])
        watch.timed("n2", 1, slow[check])
        watch.check(world_size=2)
    assert watch.named is not None and watch.still_slow("n2", 1)
    assert not watch.still_slow("n1", 0)
    for check in range(WAIT_WINDOW):  # n2 is as fast as n1 again
        watch.timed("n1", 0, fast[check])
        watch.timed("n2", 1, fast[check])
        watch.check(world_size=2)
    assert not watch.still_slow("n2", 1)


def test_ranks_are_sampled_only_once_the_attempts_start_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job whose ranks report no compute time is looked at every SAMPLE_EVERY s; but not
    while herd still starts its nodes and none of its ranks has shown progress (the nodes
    started wait at the rendezvous: on a thousand nodes, every rank's look every few seconds
    for minutes, finding only that wait). Once the start is over, the first look is at once."""
    import asyncio

    from torchherd.launcher import slow_ranks

    class Link:
        def __init__(self) -> None:
            self.commands: list[str] = []

        def command(self, name: str, **_fields: object) -> None:
            self.commands.append(name)

    def looks(start_over: list[bool], seconds: float, every: float) -> list[str]:
        """What the watch asked for: ``seconds`` starting, then 1.5 s with the start over
        (the watch ticks once a second)."""
        monkeypatch.setattr(slow_ranks, "SAMPLE_EVERY", every)
        link = Link()
        watch = slow_ranks.SlowRanks(
            {"node1": link},  # type: ignore[dict-item]
            lambda: ["node1"],
            lambda: 0.0,
            8,
            lambda _line: None,
            start_over=lambda: start_over[0],
        )

        async def run() -> None:
            task = asyncio.create_task(watch.run())
            await asyncio.sleep(seconds)
            start_over[0] = True
            await asyncio.sleep(1.5)
            task.cancel()

        asyncio.run(run())
        return link.commands

    # Starting for 4.5 s with a look due every 2 s: none then (a watch that looked would have
    # at ticks 2 and 4), one at the first tick after (5), the next not before tick 7.
    assert looks([False], 4.5, every=2.0) == ["look"]
    # Start over from the beginning, a look due every second: ticks 1, 2, 3 (4 at the cancel).
    assert looks([True], 2.5, every=1.0).count("look") >= 3
