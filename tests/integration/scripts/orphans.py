"""Test job: leaves orphans behind (`os.system("sleep 0.2 &")`), waits until they exited, then
prints how many exited children of its node agent are still unreaped (zombies).

The agent is the worker's grandparent (agent -> torchrun -> worker) and a subreaper, so the
orphaned `sleep`s become its children; when they exit, only the agent can reap them.
"""

import os
import time


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def zombies(parent: int) -> int:
    count = 0
    for task in os.listdir(f"/proc/{parent}/task"):
        with open(f"/proc/{parent}/task/{task}/children") as handle:
            for child in handle.read().split():
                try:
                    with open(f"/proc/{child}/stat") as stat:
                        count += stat.read().rsplit(")", 1)[1].split()[0] == "Z"
                except OSError:
                    continue
    return count


agent = parent_of(parent_of(os.getpid()))
for _ in range(5):
    os.system("sleep 0.2 &")
time.sleep(4)  # the sleeps are long gone; the agent had time to reap them
print(f"ZOMBIES {zombies(agent)} under agent {agent}", flush=True)
