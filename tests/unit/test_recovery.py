"""Recovery's parts alone: node liveness on a test clock, the causes table on recorded failure
output, the evidence judge on recorded py-spy dumps (the hang watch and the restart decision
have tests of their own: test_hang.py, test_restart_decision.py)."""

from __future__ import annotations

import pytest

from tests.unit.clock import Clock
from torchherd.recovery import NodeLiveness, RankStack, explain
from torchherd.recovery.evidence import judge
from torchherd.recovery.liveness import STALL, LauncherClock, steps_vouch_for

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


def test_a_stalled_launcher_blames_no_node() -> None:
    """The launcher did not run for 15 s (SIGSTOP, a suspend): on its return every node looks
    silent, with its events still waiting in the pipes. Excused, none is silent; a node that
    stays silent after the excuse is judged again from then."""
    clock = Clock()
    liveness = NodeLiveness(["a", "b"], silence=10, clock=clock)
    liveness.watch("a")
    liveness.watch("b")
    clock.advance(15)
    assert liveness.silent() == ["a", "b"]  # what a launcher without the excuse would say
    liveness.excuse()
    assert liveness.silent() == []
    clock.advance(5)
    liveness.heard("a")
    clock.advance(6)
    assert liveness.silent() == ["b"]


def test_the_launcher_clock_measures_its_own_stalls_only() -> None:
    clock = Clock()
    watch = LauncherClock(every=1.0, clock=clock)
    clock.advance(1.2)
    assert watch.tick() == 0.0  # a little late: not a stall
    clock.advance(1.0 + STALL - 0.1)
    assert watch.tick() == 0.0
    clock.advance(16.0)
    assert watch.tick() == pytest.approx(15.0)
    clock.advance(1.0)
    assert watch.tick() == 0.0  # on time again


# ---------------------------------------------------------------------------------------------
# causes, on recorded output


RECORDED = {
    "cuda-oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
    "(GPU 0; 79.11 GiB total capacity; 77.20 GiB already allocated)",
    "device-ordinal": "RuntimeError: CUDA error: invalid device ordinal\nCUDA kernel errors "
    "might be asynchronously reported",
    "abort-at-teardown": "terminate called without an active exception",
    # PyTorch's words for a CUDA kernel's failure (c10/cuda/CUDAException.cpp).
    "cuda-kernel": "RuntimeError: CUDA error: device-side assert triggered\nCUDA kernel errors "
    "might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1",
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


def test_a_quiet_link_is_not_a_lost_node_while_the_others_step() -> None:
    """The node was last heard at 100 s; the silence limit is 10 s, the cap 90 s."""
    vouch = steps_vouch_for
    assert vouch(100.0, [112.0], now=115.0, silence=10.0, limit=90.0)  # steps after its word
    assert not vouch(100.0, [103.0], now=112.0, silence=10.0, limit=90.0)  # a step in flight
    assert not vouch(100.0, [], now=112.0, silence=10.0, limit=90.0)  # no one steps
    assert not vouch(100.0, [120.0], now=135.0, silence=10.0, limit=90.0)  # they stopped too
    assert not vouch(100.0, [189.0], now=191.0, silence=10.0, limit=90.0)  # past the cap


def test_a_short_link_silence_leaves_room_for_the_others_steps() -> None:
    """link_silence 4 s: the node is judged at 4 s of quiet, so the proof (a step of the
    others after its last word, not one in flight) must be able to come within those 4 s."""
    vouch = steps_vouch_for
    assert vouch(100.0, [103.5], now=104.0, silence=4.0, limit=90.0)
    assert not vouch(100.0, [101.5], now=104.0, silence=4.0, limit=90.0)  # a step in flight


def test_the_launchers_stalls_are_told_at_most_once_a_minute() -> None:
    """On a starved machine the launcher stalls several times a minute: the first is said at
    once, the next ones in one line a minute later naming the longest and counting them all;
    none is lost (a stall told late is told at the first look after the minute)."""
    from torchherd.launcher.attempt.watch import STALL_LINE_EVERY, StallLines

    lines = StallLines()
    first = lines.stalled(12.0, now=100.0)
    assert first is not None and "did not run for 12 s" in first and "stalls" not in first
    assert lines.stalled(7.0, now=120.0) is None
    assert lines.stalled(31.0, now=140.0) is None
    assert lines.due(now=100.0 + STALL_LINE_EVERY - 1) is None
    later = lines.due(now=100.0 + STALL_LINE_EVERY)
    assert later is not None and "did not run for 31 s" in later, later
    assert "(2 stalls, 38 s in all, since the last line)" in later, later
    assert lines.due(now=500.0) is None  # nothing owed
    alone = lines.stalled(20.0, now=500.0)
    assert alone is not None and "did not run for 20 s" in alone and "stalls" not in alone
