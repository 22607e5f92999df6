"""Which processes are a job's ranks (agent.workers), on real process trees: a rank's children
(DataLoader workers) inherit its RANK but are never taken for it; their CPU counts as the
rank's; the stacks of each are kept apart (agent.stacks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from torchherd.agent import processes, stacks, workers

# A "rank" that starts a child (as a DataLoader would): both spin a little, then sleep.
RANK = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: sum(range(100000))"])
print(child.pid, flush=True)
time.sleep(600)
"""


def tagged(job: str, attempt: str = "0") -> dict[str, str]:
    """An environment of the job's on node n1, as the agent gives its processes (no rank)."""
    env = dict(os.environ, HERD_JOB_ID=job, HERD_NODE="n1", HERD_ATTEMPT=attempt)
    env.pop("RANK", None)
    return env


def start_rank(job: str, rank: int, attempt: str = "0") -> tuple[subprocess.Popen[str], int]:
    env = tagged(job, attempt) | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    process = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    child = int(process.stdout.readline())
    return process, child


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def end_trees(*started: subprocess.Popen[str]) -> None:
    """Kill each process with everything below it, and reap it."""
    for process in started:
        kill([*workers.descendants(process.pid), process.pid])
        process.wait()


def test_ranks_are_told_from_their_children() -> None:
    job = f"w-{uuid.uuid4().hex[:6]}"
    started = [start_rank(job, 0), start_rank(job, 1)]
    try:
        found = workers.find_workers(job, "n1")
        assert [(w.rank, w.pid) for w in found] == [(0, started[0][0].pid), (1, started[1][0].pid)]
        assert [w.children for w in found] == [(started[0][1],), (started[1][1],)]
        # The child's CPU is the rank's: a rank waiting on its DataLoader still works.
        rank_alone = workers.cpu_ticks([found[0].pid])
        before = workers.cpu_ticks(found[0].tree)
        deadline = time.monotonic() + 10
        while workers.cpu_ticks(found[0].tree) - before < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers.cpu_ticks(found[0].tree) - before >= 5  # the child spins
        assert workers.cpu_ticks([found[0].pid]) - rank_alone <= 2  # the rank itself sleeps
        taken = stacks.collect(job, "n1")
        assert [w["pid"] for w in taken] == [p.pid for p, _ in started]
        assert [[c["pid"] for c in w["children"]] for w in taken] == [[c] for _, c in started]
    finally:
        end_trees(*(process for process, _ in started))


def test_workers_of_one_attempt_only() -> None:
    job = f"w-{uuid.uuid4().hex[:6]}"
    old, _ = start_rank(job, 0, attempt="0")
    new, _ = start_rank(job, 0, attempt="1")
    try:
        assert [w.pid for w in workers.find_workers(job, "n1", "1")] == [new.pid]
        assert [w.pid for w in workers.find_workers(job, "n1", "0")] == [old.pid]
    finally:
        end_trees(old, new)


def test_a_sweep_of_one_attempt_leaves_the_next_alone() -> None:
    """What a sweep after a lost agent does (processes.end_job with the attempt): the old
    attempt's rank and its child end, the new attempt's run on."""
    from torchherd.agent.processes import end_job

    job = f"w-{uuid.uuid4().hex[:6]}"
    old, old_child = start_rank(job, 0, attempt="0")
    new, new_child = start_rank(job, 0, attempt="1")
    try:
        assert end_job(job, "n1", 1.0, attempt="0") == []
        old.wait(timeout=10)
        assert workers.process_state(old_child) in ("?", "Z")
        assert new.poll() is None and workers.process_state(new_child) not in ("?", "Z")
    finally:
        end_trees(old, new)


# A torchrun stand-in: a tagged process without RANK that starts one rank; the rank double-forks
# a helper (its parent exits at once, so the helper is adopted by init) and then sleeps.
LAUNCHER = """
import os, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=dict(os.environ, RANK="0",
                        LOCAL_RANK="0"), stdout=subprocess.PIPE, text=True)
print(rank.pid, rank.stdout.readline().strip(), flush=True)
rank.wait()
"""
DOUBLE_FORKING_RANK = """
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(600)
    os._exit(0)
os.wait()
time.sleep(600)
"""


def test_a_double_forked_child_is_never_a_second_copy_of_its_rank() -> None:
    job = f"w-{uuid.uuid4().hex[:6]}"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, DOUBLE_FORKING_RANK],
        env=tagged(job),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    rank, helper = (int(pid) for pid in launcher.stdout.readline().split())
    try:
        assert workers.parent(helper) != rank  # adopted: no longer in the rank's tree
        found = workers.find_workers(job, "n1")
        assert [(w.rank, w.pid) for w in found] == [(0, rank)]
        assert helper in found[0].children  # still the rank's (its CPU and I/O count)
    finally:
        kill([helper, rank, launcher.pid])
        launcher.wait()


# An agent stand-in: a subreaper (as the agent makes itself) that starts LAUNCHER.
SUBREAPER = """
import subprocess, sys
from torchherd.agent.processes import become_subreaper
become_subreaper()
launcher = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
launcher.wait()
"""


def start_agent(job: str) -> tuple[subprocess.Popen[str], tuple[int, int]]:
    """A SUBREAPER agent of the job; its rank's pid and the pid of the helper the rank
    double-forked."""
    agent = subprocess.Popen(
        [sys.executable, "-c", SUBREAPER, LAUNCHER, DOUBLE_FORKING_RANK],
        env=tagged(job),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdout is not None
    rank, helper = (int(pid) for pid in agent.stdout.readline().split())
    return agent, (rank, helper)


def test_an_agents_search_below_itself_finds_its_ranks_adopted_helpers_and_no_others() -> None:
    """What a look costs is the job's processes, not the node's (find_workers under the
    agent's pid): below one agent, its rank and the helper the rank double-forked (adopted by
    the agent, not by init); another agent's rank of the same job and node is not below it,
    though a search of the whole node finds both."""
    job = f"w-{uuid.uuid4().hex[:6]}"
    agents = [start_agent(job) for _ in range(2)]
    try:
        (rank, helper), (other_rank, _) = (started for _, started in agents)
        first, second = (agent.pid for agent, _ in agents)
        assert workers.parent(helper) == first  # adopted by the subreaper
        found = workers.find_workers(job, "n1", under=first)
        assert [(w.rank, w.pid) for w in found] == [(0, rank)]
        assert helper in found[0].children
        # The whole node's search sees both agents' processes.
        assert {rank, other_rank, helper} <= set(processes.job_processes(job, "n1"))
        assert other_rank not in processes.job_processes(job, "n1", under=first)
        assert [w["pid"] for w in stacks.collect(job, "n1", under=second)] == [other_rank]
    finally:
        end_trees(*(agent for agent, _ in agents))


# A process whose main thread waits on a lock for its other thread (as a dataset fetching
# through a thread pool does), which sleeps (--sleep) or waits in an accept (--accept, as
# multiprocessing's fd-passing listener does in every DataLoader worker that sent a batch).
POOLED = """
import socket, sys, threading, time
def other():
    if sys.argv[1] == "--sleep":
        time.sleep(600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.accept()
helper = threading.Thread(target=other, daemon=True)
helper.start()
print(helper.native_id, flush=True)
helper.join()
"""


def test_a_wait_outside_the_job_is_found_in_any_thread_but_an_accept() -> None:
    started = []
    try:
        for kind in ("--sleep", "--accept"):
            process = subprocess.Popen(
                [sys.executable, "-c", POOLED, kind], stdout=subprocess.PIPE, text=True
            )
            started.append(process)
            assert process.stdout is not None
            tid = int(process.stdout.readline())
            time.sleep(0.5)  # into the sleep, the accept
            found = workers.any_thread_waiting_outside(process.pid)
            # The main thread alone waits on a lock: nothing outside.
            assert workers.waiting_outside(process.pid, workers.thread_wait(process.pid)) is None
            if kind == "--sleep":
                assert found == f"a sleep (thread {tid})", found
            else:
                assert found is None, found
    finally:
        end_trees(*started)
