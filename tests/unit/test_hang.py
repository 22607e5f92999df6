"""The hang watch on a test clock: silence makes it look, and the looks decide.

Its verdicts are replayed on real looks recorded from real jobs (tests/unit/looks/*.json, made
by tests/unit/looks/record.py with the agent's own code): a rank stopped before and after the
first collective, a rank blocked on a lock while the other waits, every rank computing in
silence, rank 0 saving while the other waits in a barrier, every rank waiting for the other,
ranks waiting for their DataLoader workers (computing; one blocked on a lock); and waits on
the world outside the job while the other rank waits in a collective (rank 0 reading from an
HTTP server that sends a byte a second, rank 1 in a long sleep, rank 1 blocked on a file lock
another process holds, rank 1's DataLoader worker in a long sleep or reading from that server
through a thread pool), a rank deadlocked inside ``phase("saving")``, and a rank that never
exits (a non-daemon thread) after the other finished.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.unit.clock import Clock
from torchherd.recovery.hang import (
    ALL_STUCK,
    ALL_WAITING,
    ALL_WAITING_STEPS,
    CONFIRM,
    CONFIRM_STEPS,
    FINISH_GRACE,
    FIRST_COLLECTIVE,
    IDLE,
    IO_MOVING,
    LOOK_AFTER,
    LOOK_EVERY,
    LOOK_EVERY_MAX,
    OUTSIDE,
    OUTSIDE_LIMIT,
    PHASE_LIMIT,
    START_LIMIT,
    WAITING,
    HangWatch,
    RankLook,
    activity,
)

LOOKS = Path(__file__).parent / "looks"


def recorded(name: str) -> dict[str, Any]:
    return json.loads((LOOKS / f"{name}.json").read_text())


def frameless(data: dict[str, Any]) -> dict[str, Any]:
    """A recording as an agent without frames sends it (py-spy missing, or ptrace refused):
    the same kernel counters, no frames, and why (agent.look.frames_of)."""
    data = copy.deepcopy(data)
    for taken in data["looks"]:
        for seen in taken["event"]["ranks"]:
            seen["frames"] = None
            seen.pop("active", None)
            seen["error"] = "py-spy is not installed on this node"
    return data


def replay(
    name: str,
    repeat_last_for: float = 0.0,
    watch: HangWatch | None = None,
    clock: Clock | None = None,
    frames: bool = True,
) -> tuple[HangWatch, Clock, list[Any]]:
    """Feed a recording to a fresh watch, as the launcher would: workers start, the job goes
    silent, looks come every few seconds. With ``repeat_last_for``, the last look is given
    again every LOOK_EVERY s for that long (nothing moved meanwhile); without ``frames``, the
    looks carry none. The verdict after each look is returned."""
    data = recorded(name) if frames else frameless(recorded(name))
    if watch is None or clock is None:
        clock = Clock()
        watch = HangWatch(clock=clock, world_size=data["world_size"])
        watch.started()
    clock.advance(LOOK_AFTER)
    start = clock.now
    verdicts = []
    looks = data["looks"]
    for taken in looks:
        clock.now = start + taken["t"]
        watch.looked("node1", taken["event"])
        verdicts.append(watch.check())
    waited = 0.0
    while waited < repeat_last_for:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        watch.looked("node1", looks[-1]["event"])
        verdicts.append(watch.check())
    return watch, clock, verdicts


def first_hang(verdicts: list[Any]) -> tuple[int, Any]:
    for index, verdict in enumerate(verdicts):
        if verdict is not None:
            return index, verdict
    raise AssertionError("no hang found")


# ---------------------------------------------------------------------------------------------
# hangs found


@pytest.mark.parametrize("name", ["stopped-mid-run", "stopped-before-init"])
def test_a_stopped_rank_is_a_hang_once_confirmed(name: str) -> None:
    _, _, verdicts = replay(name)
    index, hang = first_hang(verdicts)
    looks = recorded(name)["looks"]
    # Not on the first look, and not before the rank has been stopped for CONFIRM seconds.
    assert index >= 1 and looks[index]["t"] - looks[0]["t"] >= CONFIRM - 0.5
    assert "node1 rank 1 stopped" in hang.reason and not hang.finished
    assert len(hang.behind) == 1 and hang.behind[0].startswith("node1 rank 1: stopped")


def test_a_rank_stopped_before_the_first_collective_is_named_where_it_stopped() -> None:
    _, _, verdicts = replay("stopped-before-init")
    _, hang = first_hang(verdicts)
    assert "worker.py" in hang.behind[0]  # its own line, not the others' init_process_group


def test_a_blocked_rank_while_the_other_waits_is_a_hang() -> None:
    _, _, verdicts = replay("blocked-rank")
    _, hang = first_hang(verdicts)
    assert "node1 rank 1 idle" in hang.reason and "all_reduce" in hang.reason
    assert hang.behind[0].startswith("node1 rank 1: blocked at <module> (worker.py:")


def test_every_rank_waiting_in_the_first_collective_gets_the_large_job_floor() -> None:
    """No step yet: communicators may take minutes to set up on a large job."""
    _, _, verdicts = replay("all-waiting", repeat_last_for=FIRST_COLLECTIVE + 2 * LOOK_EVERY)
    index, hang = first_hang(verdicts)
    looks = recorded("all-waiting")["looks"]
    waited = looks[-1]["t"] - looks[0]["t"] + (index - len(looks) + 1) * LOOK_EVERY
    assert FIRST_COLLECTIVE - LOOK_EVERY <= waited <= FIRST_COLLECTIVE + 2 * LOOK_EVERY
    assert "no rank has worked" in hang.reason and f"limit {FIRST_COLLECTIVE:.0f} s" in hang.reason


def test_silence_counts_from_the_last_nodes_start_until_a_rank_progresses() -> None:
    """Nodes that started wait at the rendezvous for the ones herd is still starting: no look
    until LOOK_AFTER s after the last start; once a rank has shown progress, a node that
    starts later does not put the silence back."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    clock.advance(LOOK_AFTER - 1)
    watch.started()  # the second node, nearly LOOK_AFTER s later
    clock.advance(LOOK_AFTER - 1)
    assert not watch.wants_look()
    clock.advance(1)
    assert watch.wants_look()
    watch.signal(0, 1)
    clock.advance(LOOK_AFTER - 1)
    watch.started()  # a node started again while the job runs: its silence goes on
    clock.advance(1)
    assert watch.wants_look()


@pytest.mark.parametrize(("step_seconds", "limit"), [(0.1, ALL_WAITING), (30.0, 300.0)])
def test_every_rank_waiting_after_steps_gets_a_limit_of_its_pace(
    step_seconds: float, limit: float
) -> None:
    """After steps: ALL_WAITING s, or ALL_WAITING_STEPS of the job's own steps if longer."""
    assert limit == max(ALL_WAITING, ALL_WAITING_STEPS * step_seconds)
    data = recorded("all-waiting")
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=data["world_size"])
    watch.started()
    for step in range(5):
        watch.signal(0, step)
        clock.advance(step_seconds)
    found, waited = None, 0.0
    while found is None and waited < 2 * limit:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        watch.looked("node1", data["looks"][-1]["event"])
        found = watch.check()
    assert found is not None and "no rank has worked" in found.reason
    assert limit <= waited <= limit + LOOK_AFTER + 2 * LOOK_EVERY


# ---------------------------------------------------------------------------------------------
# without frames (py-spy missing, ptrace not allowed): rules 1 and 3 still hold


@pytest.mark.parametrize("name", ["stopped-mid-run", "stopped-before-init"])
def test_a_stopped_rank_is_a_hang_without_frames(name: str) -> None:
    _, _, verdicts = replay(name, frames=False)
    index, hang = first_hang(verdicts)
    looks = recorded(name)["looks"]
    assert looks[index]["t"] - looks[0]["t"] >= CONFIRM - 0.5
    assert "node1 rank 1 stopped" in hang.reason
    assert hang.behind == ("node1 rank 1: stopped (state T: SIGSTOP, a debugger) at unknown",)


@pytest.mark.parametrize("name", ["all-waiting", "blocked-rank"])
def test_nobody_working_is_a_hang_at_the_all_waiting_limit_without_frames(name: str) -> None:
    """Without frames a rank in a collective cannot be told from an idle one (rule 2 needs
    both), but no CPU, no I/O and no wake-up from every rank is rule 3's picture all the same."""
    _, _, verdicts = replay(name, repeat_last_for=FIRST_COLLECTIVE + 2 * LOOK_EVERY, frames=False)
    index, hang = first_hang(verdicts)
    looks = recorded(name)["looks"]
    waited = looks[-1]["t"] - looks[0]["t"] + (index - len(looks) + 1) * LOOK_EVERY
    assert FIRST_COLLECTIVE - LOOK_EVERY <= waited <= FIRST_COLLECTIVE + 2 * LOOK_EVERY
    assert "no rank has worked" in hang.reason and f"limit {FIRST_COLLECTIVE:.0f} s" in hang.reason


@pytest.mark.parametrize("name", ["silent-compute", "silent-save", "dataloader-wait"])
def test_a_busy_job_is_not_hung_without_frames(name: str) -> None:
    _, _, verdicts = replay(name, frames=False)
    assert verdicts == [None] * len(verdicts)


# ---------------------------------------------------------------------------------------------
# busy jobs are not hung


@pytest.mark.parametrize("name", ["silent-compute", "silent-save", "dataloader-wait"])
def test_a_busy_job_is_not_hung(name: str) -> None:
    _, _, verdicts = replay(name)
    assert verdicts == [None] * len(verdicts)


def test_the_saving_rank_works_while_the_other_waits_in_its_barrier() -> None:
    looks = [
        RankLook.from_event("node1", t["event"], t["t"]) for t in recorded("silent-save")["looks"]
    ]
    before, after = ({look.rank: look for look in group} for group in looks[-2:])
    assert activity(before[0], after[0]) == "working"  # bytes to the disk, no collective
    assert activity(before[1], after[1]) == "waiting"
    assert after[1].collective is not None and "barrier" in after[1].collective


def test_ranks_waiting_for_their_dataloader_work_through_their_children() -> None:
    looks = [
        RankLook.from_event("node1", t["event"], t["t"])
        for t in recorded("dataloader-wait")["looks"]
    ]
    before, after = ({look.rank: look for look in group} for group in looks[-2:])
    assert after[0].collective is None  # waiting on a queue, not on another rank
    assert activity(before[0], after[0]) == "working"  # its DataLoader worker computes


def test_a_rank_waiting_for_its_stuck_data_loader_worker_is_a_hang() -> None:
    """Rank 1's DataLoader worker blocked on a lock, the rank polling for its batch (waking
    every few seconds), rank 0 in an all-reduce: the rank is idle as its worker is, and the
    verdict names the worker's place, not the rank's poll."""
    _, _, verdicts = replay("loader-stuck")
    index, hang = first_hang(verdicts)
    looks = recorded("loader-stuck")["looks"]
    assert looks[index]["t"] - looks[0]["t"] >= CONFIRM - 0.5
    assert "node1 rank 1 idle" in hang.reason and "all_reduce" in hang.reason, hang.reason
    assert "in its data-loader worker too" in hang.reason, hang.reason
    assert re.match(
        r"node1 rank 1: blocked at its data-loader worker \(pid \d+\) at Held.__getitem__ "
        r"\(worker.py:\d+\)",
        hang.behind[0],
    ), hang.behind


def test_a_data_loader_worker_waiting_for_work_leaves_its_rank_idle() -> None:
    """The rank waits for a batch while its only worker waits for the next batch's indices
    (a batch lost between them): its poll is on the rank's own queue, not the world."""
    idle_worker = [
        "_PollLikeSelector.select (selectors.py:415)",
        "Queue.get (multiprocessing/queues.py:113)",
        "_worker_loop (torch/utils/data/_utils/worker.py:330)",
    ]
    rank = {
        "state": "S",
        "cpu": 0,
        "io": 0,
        "frames": [
            "_MultiProcessingDataLoaderIter._try_get_data (torch/utils/data/dataloader.py:1)"
        ],
        "pid": 5,
        "rank": 1,
        "main": {"switches": 100},
        "outside": "a poll (sockets or pipes)",
    }
    waiting = {"pid": 6, "state": "S", "outside": "a poll (sockets or pipes)"}
    first = RankLook.from_event(
        "n", event(dict(rank, loader=[waiting | {"frames": idle_worker}])), 0
    )
    later = dict(rank, main={"switches": 103}, loader=[waiting | {"frames": idle_worker}])
    assert activity(first[0], RankLook.from_event("n", event(later), 5.0)[0]) == IDLE
    # The same worker reading from a socket inside the dataset: the world outside the job.
    reading = ["recv_into (socket.py:706)", "Shards.__getitem__ (data.py:9)", *idle_worker[2:]]
    later = dict(rank, loader=[waiting | {"frames": reading, "outside": "a read on a socket"}])
    after = RankLook.from_event("n", event(later), 5.0)[0]
    assert activity(first[0], after) == OUTSIDE
    assert after.waits_outside == "a read on a socket, in its data-loader worker (pid 6)"
    # A worker whose frames were not taken (past the agent's cap) and that polls: it may be
    # waiting for its next indices or on a socket; the watch takes it as outside (no verdict).
    unframed = {"pid": 7, "state": "S", "outside": "a poll (sockets or pipes)", "frames": None}
    later = dict(rank, loader=[waiting | {"frames": idle_worker}, unframed])
    assert activity(first[0], RankLook.from_event("n", event(later), 5.0)[0]) == OUTSIDE


# ---------------------------------------------------------------------------------------------
# the rules on made-up looks (long limits, the plain limit, phases, stalls)


def look(
    rank: int,
    at: float,
    *,
    state: str = "S",
    cpu: int = 0,
    io: int = 0,
    frames: tuple[str, ...] | None = ("f (train.py:1)",),
    phase: str | None = None,
    pid: int | None = None,
    gpu: bool = False,
) -> dict[str, Any]:
    return {
        "gpu": gpu,
        "rank": rank,
        "pid": pid or 100 + rank,
        "state": state,
        "cpu": cpu,
        "io": io,
        "frames": None if frames is None else list(frames),
        "phase": phase,
    }


def event(*ranks: dict[str, Any]) -> dict[str, Any]:
    return {"e": "look", "ticks": 100, "ranks": list(ranks)}


def spin(gpu: bool, seconds: float) -> tuple[Any, float]:
    """Two ranks at the same line, a whole core each, no I/O, for up to ``seconds``."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    cpu = 0
    found = None
    elapsed = 0.0
    while found is None and elapsed < seconds:
        clock.advance(LOOK_EVERY)
        elapsed += LOOK_EVERY
        cpu += int(100 * LOOK_EVERY)
        frames = ("item (train.py:40)",)
        watch.looked(
            "n",
            event(
                look(0, 0, cpu=cpu, frames=frames, gpu=gpu),
                look(1, 0, cpu=cpu, frames=frames, gpu=gpu),
            ),
        )
        found = watch.check()
    return found, elapsed


def test_every_gpu_rank_spinning_at_the_same_place_is_a_hang_after_the_longest_limit() -> None:
    """Ranks busy-waiting on a GPU that never finishes: CPU used, frames and I/O frozen."""
    found, elapsed = spin(gpu=True, seconds=ALL_STUCK + 60)
    assert found is not None and "same place" in found.reason
    assert elapsed >= ALL_STUCK


def test_cpu_ranks_computing_in_one_line_are_working_however_long() -> None:
    found, _ = spin(gpu=False, seconds=4 * ALL_STUCK)
    assert found is None


def test_moving_frames_keep_a_silent_job_alive() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    for step in range(200):  # 1,000 s of silence, the frames moving every look
        clock.advance(LOOK_EVERY)
        watch.looked("n", event(look(0, 0, frames=(f"eval (train.py:{step % 7})",))))
        assert watch.check() is None


def test_a_declared_phase_counts_as_work_but_a_stopped_rank_is_still_a_hang() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    watch.phase(0, "saving snapshot")
    for _ in range(int(ALL_STUCK / LOOK_EVERY) + 5):  # rank 0 "saves" with nothing moving
        clock.advance(LOOK_EVERY)
        watch.looked(
            "n",
            event(
                look(0, 0, phase="saving snapshot"),
                look(1, 0, frames=("barrier (torch/distributed/x.py:1)",)),
            ),
        )
        assert watch.check() is None
    for _ in range(int(CONFIRM / LOOK_EVERY) + 2):
        clock.advance(LOOK_EVERY)
        watch.looked(
            "n",
            event(
                look(0, 0, state="T", phase="saving snapshot"),
                look(1, 0, frames=("barrier (torch/distributed/x.py:1)",)),
            ),
        )
    hang = watch.check()
    assert hang is not None and "rank 0 stopped" in hang.reason


def test_nothing_is_judged_while_a_rank_is_missing() -> None:
    """Ranks not seen yet (a node's workers respawning): only a stopped rank is judged."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=3)
    watch.started()
    for _ in range(int(ALL_WAITING / LOOK_EVERY) + 5):
        clock.advance(LOOK_EVERY)
        watch.looked(
            "n",
            event(
                look(0, 0, frames=("all_reduce (torch/distributed/c.py:1)",)),
                look(1, 0, frames=("f (train.py:3)",)),
            ),
        )
        assert watch.check() is None


def test_a_new_process_for_a_rank_starts_its_story_afresh() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    clock.advance(LOOK_EVERY)
    watch.looked("n", event(look(0, 0, state="T", pid=7)))
    clock.advance(CONFIRM - 1)
    watch.looked("n", event(look(0, 0, state="T", pid=8)))  # same rank, another process
    clock.advance(2)
    watch.looked("n", event(look(0, 0, state="T", pid=8)))
    assert watch.check() is None  # stopped for 2 s only, as far as pid 8 goes


def test_the_plain_limit_counts_from_the_first_signal() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    watch.started()
    clock.advance(3600)  # start-up: importing, the rendezvous, loading data
    assert watch.check() is None
    watch.signal(0)
    clock.advance(4)
    watch.signal(1)
    clock.advance(4.9)
    assert watch.check() is None
    clock.advance(0.2)
    hang = watch.check()
    assert hang is not None and "limit 5 s, set by --hang-timeout" in hang.reason


def test_beats_alone_keep_a_job_alive_under_the_plain_limit() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    watch.started()
    for step in range(100):
        watch.signal(0, step)
        clock.advance(2)
        assert watch.check() is None
    assert watch.steps == {0: 99} and watch.max_step == 99


def test_zero_turns_the_watch_off() -> None:
    clock = Clock()
    watch = HangWatch(timeout=0, clock=clock, world_size=1)
    watch.started()
    watch.signal(0)
    clock.advance(10**6)
    watch.looked("n", event(look(0, 0, state="T")))
    assert watch.check() is None and not watch.wants_look()


def test_torchruns_own_lines_are_no_progress() -> None:
    clock = Clock()
    watch = HangWatch(timeout=5, clock=clock)
    watch.started()
    watch.signal(None)
    clock.advance(100)
    assert watch.check() is None  # no rank has spoken: the plain limit is not armed


def test_looks_come_after_silence_and_thin_out_while_everyone_works() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    clock.advance(LOOK_AFTER - 1)
    assert not watch.wants_look()
    clock.advance(1)
    assert watch.wants_look() and not watch.wants_look()  # one look, then wait
    gaps = []
    last = clock.now
    for step in range(40):
        clock.advance(1)
        if watch.wants_look():
            gaps.append(clock.now - last)
            last = clock.now
            watch.looked("n", event(look(0, 0, cpu=step * 1000)))  # busy: working
    assert gaps[0] == LOOK_EVERY and gaps[-1] > gaps[0] and max(gaps) <= LOOK_EVERY_MAX
    watch.signal(0)  # progress: silence starts again
    clock.advance(LOOK_AFTER - 1)
    assert not watch.wants_look()


def test_a_stalled_launcher_does_not_count_its_own_absence_as_silence() -> None:
    clock = Clock()
    watch = HangWatch(timeout=30, clock=clock)
    watch.started()
    watch.signal(0)
    clock.advance(25)
    clock.advance(60)  # herd itself was stopped for a minute
    watch.excuse(60)
    assert watch.check() is None
    clock.advance(6)
    assert watch.check() is not None


# ---------------------------------------------------------------------------------------------
# waits on the world outside the job: minutes, not seconds


@pytest.mark.parametrize(
    ("name", "rank", "what"),
    [
        ("socket-wait", 0, "a read on a socket"),
        ("backoff-sleep", 1, "a sleep"),
        ("lock-wait", 1, "a file lock"),
        ("loader-sleep", 1, "a sleep, in its data-loader worker"),
        ("loader-pool-read", 1, "a read on a socket (thread "),
    ],
)
def test_a_rank_waiting_on_the_world_is_not_hung_for_minutes(
    name: str, rank: int, what: str
) -> None:
    """A download, a backoff, a lock held by another process, while the other rank waits in
    a collective: not idle. After OUTSIDE_LIMIT s it is a hang, naming what it waits on."""
    _, _, verdicts = replay(name, repeat_last_for=OUTSIDE_LIMIT - 60)
    assert verdicts == [None] * len(verdicts)
    _, _, verdicts = replay(name, repeat_last_for=OUTSIDE_LIMIT + 2 * LOOK_EVERY)
    _, hang = first_hang(verdicts)
    assert f"node1 rank {rank} waited outside the job" in hang.reason
    assert f"limit {OUTSIDE_LIMIT:g} s" in hang.reason
    assert hang.behind[0].startswith(f"node1 rank {rank}: waiting on {what}")


def test_disk_wait_is_waiting_outside() -> None:
    """State D (a slow NFS or Lustre mount): the lock-wait recording with rank 1's main
    thread put in state D instead (a slow mount cannot be made on this machine)."""
    looks = [
        RankLook.from_event("node1", t["event"], t["t"]) for t in recorded("lock-wait")["looks"]
    ]
    before, after = ({look.rank: look for look in group} for group in looks[-2:])
    in_d = dataclasses.replace(after[1], state="D", outside=None)
    assert in_d.waits_outside is not None and "state D" in in_d.waits_outside
    assert activity(before[1], in_d) == OUTSIDE
    assert activity(before[0], after[0]) == WAITING


def test_a_rank_that_keeps_waking_is_not_frozen() -> None:
    """No CPU worth the name, no I/O, the same frames, no known wait: but its main thread is
    switched in and out between looks (a polling loop): outside, not idle."""
    base = {
        "state": "S",
        "cpu": 0,
        "io": 0,
        "frames": ["poll (train.py:9)"],
        "pid": 5,
        "rank": 0,
        "main": {"switches": 100},
    }
    woke = dict(base, main={"switches": 130})
    still = dict(base)
    first = RankLook.from_event("n", event(base), 0.0)[0]
    assert activity(first, RankLook.from_event("n", event(woke), 5.0)[0]) == OUTSIDE
    assert activity(first, RankLook.from_event("n", event(still), 5.0)[0]) == IDLE


def test_the_confirmation_window_follows_the_jobs_pace() -> None:
    """A blocked rank is named after CONFIRM s, or CONFIRM_STEPS of the job's steps."""
    data = recorded("blocked-rank")

    def named_after(step_seconds: float) -> float:
        clock = Clock()
        watch = HangWatch(clock=clock, world_size=2)
        watch.started()
        for step in range(4):
            watch.signal(0, step)
            clock.advance(step_seconds)
        watch.signal(0, 4)
        waited = 0.0
        while waited < 600:
            clock.advance(LOOK_EVERY)
            waited += LOOK_EVERY
            watch.looked("node1", data["looks"][-1]["event"])
            if watch.check() is not None:
                return waited
        raise AssertionError("never named")

    fast, slow = named_after(0.05), named_after(20.0)
    assert fast <= CONFIRM + 2 * LOOK_EVERY
    assert CONFIRM_STEPS * 20.0 <= slow <= CONFIRM_STEPS * 20.0 + 2 * LOOK_EVERY


# ---------------------------------------------------------------------------------------------
# phases have limits


def phase_deadlock(timeout: float | None) -> tuple[int, Any, float]:
    """Replay rank 1 deadlocked inside phase("saving") (rank 0 waits in a barrier), as the
    launcher sees it: a line from each rank, the phase, then silence and looks."""
    clock = Clock()
    watch = HangWatch(timeout=timeout, clock=clock, world_size=2)
    watch.started()
    watch.signal(0)
    watch.signal(1)
    watch.phase(1, "saving")
    start = clock.now
    _, _, verdicts = replay(
        "phase-deadlock", repeat_last_for=OUTSIDE_LIMIT + 60, watch=watch, clock=clock
    )
    index, hang = first_hang(verdicts)
    looks = recorded("phase-deadlock")["looks"]
    at = LOOK_AFTER + looks[min(index, len(looks) - 1)]["t"] - looks[0]["t"]
    at += max(0, index - len(looks) + 1) * LOOK_EVERY
    assert clock.now - start >= at - 1
    return index, hang, at


def test_hang_timeout_applies_inside_a_phase_and_names_the_rank() -> None:
    _, hang, at = phase_deadlock(timeout=60)
    assert 60 <= at <= 60 + 2 * LOOK_EVERY
    assert "set by --hang-timeout" in hang.reason and "rank 1 in phase 'saving'" in hang.reason
    assert any(line.startswith("node1 rank 1: idle in phase 'saving'") for line in hang.behind)


def test_a_phase_that_shows_nothing_for_the_hang_limit_is_judged_like_any_wait() -> None:
    """No --hang-timeout: no CPU, I/O, frame change or wake-up for OUTSIDE_LIMIT s inside a
    phase, while the other rank waits in a barrier: idle, named."""
    _, hang, at = phase_deadlock(timeout=None)
    assert OUTSIDE_LIMIT <= at <= OUTSIDE_LIMIT + 2 * LOOK_EVERY + LOOK_AFTER
    assert "node1 rank 1 idle" in hang.reason and "barrier" in hang.reason


def test_a_phase_ends_at_its_limit_even_while_the_rank_works() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    watch.phase(0, "uploading")
    cpu, found, waited = 0, None, 0.0
    while found is None and waited < 400:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        cpu += 100 * int(LOOK_EVERY)
        seen = look(0, 0, cpu=cpu, phase="uploading") | {"phase_limit": 300}
        watch.looked("n", event(seen))
        found = watch.check()
    assert found is not None and "in phase 'uploading'" in found.reason
    assert "limit 300 s" in found.reason and 300 <= waited <= 300 + 2 * LOOK_EVERY


def test_a_phase_without_a_limit_gets_the_default() -> None:
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    watch.phase(0, "evaluating")
    cpu, found, waited = 0, None, 0.0
    while found is None and waited < PHASE_LIMIT + 120:
        clock.advance(LOOK_EVERY_MAX)
        waited += LOOK_EVERY_MAX
        cpu += 100 * int(LOOK_EVERY_MAX)
        watch.looked("n", event(look(0, 0, cpu=cpu, phase="evaluating")))
        found = watch.check()
    assert found is not None and f"limit {PHASE_LIMIT:g} s" in found.reason
    assert waited >= PHASE_LIMIT


# ---------------------------------------------------------------------------------------------
# every rank is watched, present or missing


def test_a_rank_that_never_exits_after_the_others_finished_is_named() -> None:
    """Rank 0's node finished; rank 1's interpreter waits for a non-daemon thread forever."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    watch.finished()  # rank 0's node: every worker exited 0
    _, _, verdicts = replay(
        "never-exits", repeat_last_for=FINISH_GRACE + 2 * LOOK_EVERY, watch=watch, clock=clock
    )
    index, hang = first_hang(verdicts)
    assert index >= 2
    assert hang.reason.startswith("finished, but node1 rank 1 never exited") and hang.finished
    assert hang.behind[0].startswith("node1 rank 1: still running at _shutdown (threading.py")


def test_a_rank_that_leaves_the_looks_marks_the_others_finish() -> None:
    """Both ranks on one node: rank 0 exits, rank 1 stays; torchrun waits, herd does not."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    clock.advance(LOOK_AFTER)
    both = event(look(0, 0, frames=("f (train.py:1)",)), look(1, 0, frames=("f (train.py:1)",)))
    watch.looked("n", both)
    assert watch.finished_at is None
    found, waited = None, 0.0
    while found is None and waited < 200:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        watch.looked("n", event(look(1, 0, frames=("_shutdown (threading.py:1590)",))))
        found = watch.check()
    assert found is not None and "never exited" in found.reason
    assert FINISH_GRACE <= waited <= FINISH_GRACE + 2 * LOOK_EVERY


def test_a_rank_still_working_after_the_others_finished_gets_minutes() -> None:
    """Rank 0 uploads the final model while the others have exited: work, for a while."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    watch.finished()
    cpu = 0
    for _ in range(int(OUTSIDE_LIMIT / LOOK_EVERY) - 2):
        clock.advance(LOOK_EVERY)
        cpu += 100 * int(LOOK_EVERY)
        watch.looked("n", event(look(0, 0, cpu=cpu)))
        assert watch.check() is None


@pytest.mark.parametrize("working", [False, True], ids=["idle", "working"])
def test_with_a_plain_limit_a_rank_outliving_the_others_by_it_never_exited(working: bool) -> None:
    """--hang-timeout 20: rank 0's node finished; rank 1 waits for a thread (or works) on.
    20 s later it never exited: the job finished (nothing to restart), not a hang, which the
    plain limit alone would have said (and restarted a finished job)."""
    clock = Clock()
    watch = HangWatch(timeout=20, clock=clock, world_size=2)
    watch.started()
    watch.signal(0, 5)
    watch.signal(1, 5)
    watch.finished()
    cpu, found, waited = 0, None, 0.0
    while found is None and waited < 200:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        cpu += 100 * int(LOOK_EVERY) if working else 0
        frames = ("_shutdown (threading.py:1590)",)
        watch.looked("n", event(look(1, 0, cpu=cpu, frames=frames)))
        found = watch.check()
    assert found is not None and found.finished, found
    assert found.reason.startswith("finished, but n rank 1 never exited"), found.reason
    assert 20 <= waited <= 20 + 2 * LOOK_EVERY


def test_a_nodes_report_is_progress_for_each_rank_in_it_and_an_empty_one_is_none() -> None:
    """A node's report (its ranks' newest steps, or lines: no step) is each rank's progress,
    one new silence for the lot; a report that names no rank leaves the silence running."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=3)
    watch.started()
    clock.advance(5.0)
    watch.progressed("a", [(0, 3), (1, None)])
    assert watch.steps == {0: 3} and watch.last_signal == {0: clock(), 1: clock()}
    assert watch.silent_for() == 0.0
    clock.advance(5.0)
    watch.progressed("a", [])
    assert watch.silent_for() == 5.0
    watch.progressed("b", [(2, 7), (0, 2)])  # rank 0's older step does not lower its own
    assert watch.steps == {0: 3, 2: 7} and watch.max_step == 7 and watch.silent_for() == 0.0


def test_a_node_whose_ranks_all_left_marks_the_others_finish() -> None:
    """torchrun waits at its exit barrier (minutes) for the other nodes: its node does not end,
    but its looks come back empty. A rank still running elsewhere is named."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=2)
    watch.started()
    watch.seen("a", 0)  # rank 0 spoke from node a, then exited before any look
    watch.seen("b", 1)
    clock.advance(LOOK_AFTER)
    found, waited = None, 0.0
    while found is None and waited < 200:
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
        watch.looked("a", event())
        watch.looked("b", event(look(1, 0, frames=("_shutdown (threading.py:1590)",))))
        found = watch.check()
    assert found is not None and found.reason.startswith("finished, but b rank 1 never exited")
    assert found.finished


# ---------------------------------------------------------------------------------------------
# a node's torchrun before it has started its workers (its "torchrun" in a look)


def torchrun(state: str = "S", cpu: int = 0, io: int = 0, pid: int = 50) -> dict[str, Any]:
    """A look's ``torchrun`` entry, shaped as agent.look.look_at_torchrun gives it."""
    return {"pid": pid, "state": state, "cpu": cpu, "io": io, "main": {}}


def start_up(
    nodes: dict[str, Any], seconds: float, ranks: dict[str, list[dict[str, Any]]] | None = None
) -> tuple[Any, float]:
    """Looks every LOOK_EVERY s, each node's torchrun given by ``nodes[host](elapsed)``; the
    first verdict and when it came."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=3)
    watch.started()
    clock.advance(LOOK_AFTER)
    waited = 0.0
    while waited <= seconds:
        for host, entry in nodes.items():
            watch.looked(host, {**event(*(ranks or {}).get(host, [])), "torchrun": entry(waited)})
        found = watch.check()
        if found is not None:
            return found, waited
        clock.advance(LOOK_EVERY)
        waited += LOOK_EVERY
    return None, waited


def test_a_torchrun_stopped_before_it_starts_its_workers_is_named() -> None:
    """node3's torchrun was stopped at its start; the others' torchruns wait for it."""
    found, waited = start_up(
        {
            "node1": lambda t: torchrun(),
            "node2": lambda t: torchrun(),
            "node3": lambda t: torchrun("T"),
        },
        120,
    )
    assert found is not None and CONFIRM <= waited <= CONFIRM + LOOK_EVERY
    assert found.reason.startswith("node3: torchrun stopped (state T") and not found.finished
    assert found.behind == ("node3: torchrun (pid 50) stopped before starting its workers",)
    assert found.node == "node3"


def test_a_stopped_torchrun_is_named_while_the_other_nodes_ranks_wait_for_it() -> None:
    """The others' workers started and wait in their first collective for node3's rank."""
    waiting = ("init_process_group (torch/distributed/distributed_c10d.py:1)",)
    found, _ = start_up(
        {"node1": lambda t: torchrun(), "node3": lambda t: torchrun("T")},
        120,
        ranks={"node1": [look(0, 0, frames=waiting), look(1, 0, frames=waiting)]},
    )
    assert found is not None and found.reason.startswith("node3: torchrun stopped")


def test_a_torchrun_that_works_at_start_up_is_never_judged() -> None:
    """node3's torchrun imports torch from a slow filesystem for 10 minutes (CPU, I/O, state
    D in turn) while the others' torchruns wait for it in the rendezvous: not a hang."""

    def importing(t: float) -> dict[str, Any]:
        phase = int(t / LOOK_EVERY) % 3
        return torchrun("D" if phase == 2 else "R", cpu=int(t * 50), io=int(t) * IO_MOVING)

    found, _ = start_up(
        {"node1": lambda t: torchrun(), "node2": lambda t: torchrun(), "node3": importing},
        600,
    )
    assert found is None


def test_no_torchrun_starting_its_workers_and_none_working_is_a_hang_at_the_start_limit() -> None:
    found, waited = start_up({h: lambda t: torchrun() for h in ("node1", "node2", "node3")}, 400)
    assert found is not None and START_LIMIT <= waited <= START_LIMIT + 2 * LOOK_EVERY
    assert "no node has started its workers" in found.reason
    assert len(found.behind) == 3


def test_a_node_whose_ranks_were_seen_is_no_longer_judged_by_its_torchrun() -> None:
    """torchrun stopped after its worker started (the worker runs on): the ranks are judged."""
    clock = Clock()
    watch = HangWatch(clock=clock, world_size=1)
    watch.started()
    watch.seen("node1", 0)
    clock.advance(LOOK_AFTER)
    for _ in range(10):
        watch.looked("node1", {**event(look(0, 0)), "torchrun": torchrun("T")})
        assert watch.check() is None or "torchrun" not in watch.check().reason
        clock.advance(LOOK_EVERY)


def test_the_agent_reads_a_stopped_torchrun_as_stopped() -> None:
    """agent.look.look_at_torchrun on a real stopped process."""
    import signal
    import subprocess
    import time

    from torchherd.agent.look import look_at_torchrun

    process = subprocess.Popen(["sleep", "30"])
    try:
        # Not stopped yet (D: a moment in uninterruptible sleep, seen while exec'ing on a
        # loaded machine).
        assert look_at_torchrun(process.pid)["state"] in ("S", "R", "D")
        process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while look_at_torchrun(process.pid)["state"] != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = look_at_torchrun(process.pid)
        assert seen["state"] == "T" and seen["pid"] == process.pid
        assert isinstance(seen["cpu"], int) and "main" in seen
    finally:
        process.kill()
        process.wait()
