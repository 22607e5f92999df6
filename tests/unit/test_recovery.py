"""Recovery's parts alone: the hang watch and node liveness on a test clock, the causes table
on recorded failure output, the evidence judge on recorded py-spy dumps, the restart policy."""

from __future__ import annotations

import pytest

from torchherd.recovery import HangWatch, NodeLiveness, RankStack, RestartPolicy, explain
from torchherd.recovery.evidence import judge
from torchherd.recovery.hang import FLOOR
from torchherd.recovery.policy import PROGRESS_BY_TIME, made_progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---------------------------------------------------------------------------------------------
# hang watch


def test_nothing_is_judged_before_the_first_signal() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    clock.advance(3600)  # an hour of start-up: importing, rendezvous, loading data
    assert watch.check() is None


def test_fixed_timeout_counts_from_the_last_signal_of_any_rank() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    watch.signal(0)
    clock.advance(4)
    watch.signal(1)
    clock.advance(4.9)
    assert watch.check() is None
    clock.advance(0.2)
    hang = watch.check()
    assert hang is not None and hang.limit == 5 and "--hang-timeout" in hang.how


def test_zero_turns_the_watch_off() -> None:
    clock = Clock()
    watch = HangWatch(timeout=0, clock=clock)
    watch.signal(0)
    clock.advance(10**6)
    assert watch.check() is None


def test_torchruns_own_lines_are_no_progress() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    watch.signal(None)
    clock.advance(100)
    assert watch.check() is None  # never armed: no rank said anything


def test_learned_limit_waits_for_the_jobs_rhythm_then_uses_the_floor() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock)
    for _ in range(2):  # two signs: not yet a rhythm
        watch.signal(0)
        clock.advance(10)
    clock.advance(500)
    assert watch.check() is None
    watch.signal(0)  # the third sign arms the watch; the longest gap was 510 s
    limit = watch.limit()
    assert limit is not None and limit[0] == pytest.approx(1530.0)


def test_a_script_that_prints_once_an_hour_is_not_killed() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock)
    for _ in range(3):
        watch.signal(0)
        clock.advance(3600)
        assert watch.check() is None
    limit = watch.limit()
    assert limit is not None and limit[0] == pytest.approx(3 * 3600)


def test_a_steady_job_that_stops_is_hung_after_the_floor() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock)
    for step in range(20):
        watch.signal(0, step)
        watch.signal(1, step)
        clock.advance(2)
    clock.advance(FLOOR - 3)  # a second short of the floor since the last signal
    assert watch.check() is None
    clock.advance(2)
    hang = watch.check()
    assert hang is not None and hang.limit == FLOOR and "floor" in hang.how
    assert watch.steps == {0: 19, 1: 19} and watch.max_step == 19


def test_a_burst_of_lines_is_one_sign() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock)
    for _ in range(50):  # 50 ranks say hello at once
        watch.signal(0)
        clock.advance(0.001)
    assert watch.limit() is None


# ---------------------------------------------------------------------------------------------
# liveness


def test_a_node_is_silent_only_while_watched_and_after_the_limit() -> None:
    clock = Clock()
    liveness = NodeLiveness(["a", "b"], silence=10, clock=clock)
    clock.advance(60)
    assert liveness.silent() == []  # not watched yet: still connecting
    liveness.watch("a")
    liveness.watch("b")
    clock.advance(9)
    liveness.heard("b")
    clock.advance(2)
    assert liveness.silent() == ["a"]
    liveness.forget("a")
    assert liveness.silent() == []


# ---------------------------------------------------------------------------------------------
# causes, on recorded output


RECORDED = {
    "cuda-oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
    "(GPU 0; 79.11 GiB total capacity; 77.20 GiB already allocated)",
    "device-ordinal": "RuntimeError: CUDA error: invalid device ordinal\nCUDA kernel errors "
    "might be asynchronously reported",
    "abort-at-teardown": "terminate called without an active exception",
    "nccl": "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:275, unhandled system error (run with NCCL_DEBUG=INFO for details), "
    "NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or external "
    "library call failed or device error.\nLast error:\nsocketStartConnect: Connect to "
    "10.0.0.2<53125> failed : Software caused connection abort",
    "rendezvous-timeout": "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
    "address-in-use": "RuntimeError: The server socket has failed to listen on any local "
    "network address. port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address "
    "already in use",
    "version-mismatch": "ImportError: /venv/lib/python3.11/site-packages/torch/lib/"
    "libtorch_cuda.so: undefined symbol: ncclCommSplit",
    "peer-connection": "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Read error [10.0.0.3]:21345: Connection reset by peer",
}


@pytest.mark.parametrize("kind", sorted(RECORDED))
def test_each_recorded_failure_gets_its_cause(kind: str) -> None:
    cause = explain(RECORDED[kind])
    assert cause is not None and cause.kind == kind
    assert cause.cause and cause.fix


def test_an_unknown_failure_has_no_invented_cause() -> None:
    assert explain("ValueError: my own bug in train.py line 12") is None


# ---------------------------------------------------------------------------------------------
# evidence, on recorded py-spy dumps

IN_ALLREDUCE = """Process 4711: python steps.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4711 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2806)
    wrapper (torch/distributed/c10d_logger.py:81)
    <module> (steps.py:33)
Thread 4790 (idle): "Thread-1"
    _worker (loader.py:20)
"""
IN_DATA = """Process 4712: python steps.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4712 (active): "MainThread"
    read_chunk (dataset.py:88)
    __getitem__ (dataset.py:40)
    <module> (steps.py:30)
"""


def stack(rank: int, text: str, state: str = "S", host: str = "n1") -> RankStack:
    return RankStack(host, rank, rank, 4711 + rank, state, text)


def test_a_stopped_rank_is_behind() -> None:
    found = judge([stack(0, IN_ALLREDUCE), stack(1, IN_ALLREDUCE, state="T", host="n2")])
    assert [(b.host, b.rank) for b in found] == [("n2", 1)]
    assert "stopped" in found[0].why and "all_reduce" in found[0].why


def test_the_rank_outside_the_collective_is_behind() -> None:
    ranks = [stack(0, IN_ALLREDUCE), stack(1, IN_DATA), stack(2, IN_ALLREDUCE)]
    found = judge(ranks)
    assert [b.rank for b in found] == [1]
    assert "read_chunk (dataset.py:88)" in found[0].why and "all_reduce" in found[0].why


def test_with_equal_stacks_the_lowest_step_is_behind() -> None:
    ranks = [stack(0, IN_ALLREDUCE), stack(1, IN_ALLREDUCE)]
    assert [b.rank for b in judge(ranks, {0: 41, 1: 40})] == [1]
    assert judge(ranks, {0: 41, 1: 41}) == []


def test_main_frames_skip_other_threads() -> None:
    assert stack(0, IN_ALLREDUCE).main_frames[0].startswith("all_reduce")
    assert stack(0, IN_ALLREDUCE).in_collective
    assert not stack(1, IN_DATA).in_collective


# ---------------------------------------------------------------------------------------------
# policy


def test_restart_budget_and_node_count() -> None:
    policy = RestartPolicy(max_restarts=2, min_nodes=2)
    assert policy.should_restart(1, 0) and policy.should_restart(1, 1)
    assert not policy.should_restart(1, 2)
    assert not policy.should_restart(130, 0)  # interrupted: never restarted
    assert policy.enough_nodes(2, 3) and not policy.enough_nodes(1, 3)
    assert not RestartPolicy().enough_nodes(2, 3)  # by default every node is needed


def test_progress_is_a_higher_step_or_a_long_run_without_steps() -> None:
    assert made_progress(None, 5, 1)
    assert made_progress(40, 41, 1)
    assert not made_progress(40, 40, 10_000)
    assert not made_progress(None, None, 10)
    assert made_progress(None, None, PROGRESS_BY_TIME)
