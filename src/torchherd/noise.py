"""Which worker and agent lines the console leaves out: torch's chatter that says nothing herd
has not said better. Every such line is still written to the job's log files.

Two kinds:

- always noise: lines torch prints on every rank or node whatever happens, each of which herd
  says in its own words when it matters: c10d's "The hostname of the client socket cannot be
  retrieved" (a reverse lookup that fails on most clusters, harmless), the elastic agent's
  "To enable traceback see: ..." (herd's summary shows the failure and its traceback), the
  agent's own shutdown lines ("Received 15 death signal, shutting down workers", "Sending
  process N closing signal SIGTERM"): herd stops the job and says so; and the C++ frames
  torch prints under an error ("Exception raised from recvBytes at ...", "frame #3: ... (0x7f..
  in libtorch_cpu.so)"), dozens of lines of addresses whose message line above them stays;
  and torchft's chatter as a replica group heals (a note on NCCL's flight recorder, its
  checkpoint server's access log, torch's warning on the received weights).
- noise once herd has given its verdict (a failure, a hang, a lost node, Ctrl-C): the dying
  words of ranks and agents that herd is stopping: torch's glog-style warnings and errors
  (``[W1124 10:00:00.123 42 file.cpp:12] [c10d] ...``) about the store herd closed, a peer
  gone, ``terminate called``. Before the verdict these reach the console: they may be the
  first sign of the failure.

``Chatter`` holds the one piece of state (has the verdict been given?) and judges line by line.
"""

from __future__ import annotations

import re

ALWAYS = re.compile(
    r"hostname of the client socket cannot be retrieved"
    r"|To enable traceback see: https?://\S*elastic/errors"
    r"|Received \d+ death signal, shutting down workers"
    r"|Sending process \d+ closing signal SIG[A-Z]+"
    r"|^\s*frame #\d+: .*\(0x[0-9a-f]+"
    r"|^\s*Exception raised from \S+ at \S+ \(most recent call first\):"
    # torchft, as a replica group heals (herd and the Trainer say it in their words): its
    # reconfigure's note about NCCL's flight recorder (on Gloo too), the checkpoint server's
    # access log, and torch's warning (and its source line) on the weights it received.
    r"|Unable to reset NCCL flight recorder recording"
    r"|\"GET /checkpoint/\d+/\S* HTTP/1\.[01]\" \d+ "
    r"|_serialization\.py:\d+: UserWarning: The given buffer is not writable"
    r"|^\s*storage = torch\.frombuffer\($"
)
"""Lines never shown on the console (kept in the logs)."""

AFTER_VERDICT = re.compile(
    r"^\s*\[?[WEIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
    r"|^\s*terminate called after throwing an instance of"
    r"|^\s*what\(\):"
    r"|^\s*torch\.distributed\.elastic\.\S*(Error|Exception)\b"
    r"|^\s*(torch\.distributed\.)?DistStoreError\b"
    r"|\[c10d\] .*(Connection reset by peer|Broken pipe|Connection refused|failed to recv)"
)
"""Lines of agents and ranks being stopped, shown only before herd's verdict."""


def is_noise(text: str, after_verdict: bool) -> bool:
    """Whether the console leaves out ``text`` (a worker or agent line)."""
    if ALWAYS.search(text):
        return True
    return after_verdict and AFTER_VERDICT.search(text) is not None


class Chatter:
    """The console's filter for one job: ``verdict()`` once herd has said how an attempt ends.
    A new attempt starts quiet again (``next_attempt``): its lines matter."""

    def __init__(self) -> None:
        self.after_verdict = False
        self.left_out = 0
        """Lines left out of the console so far (all in the log files)."""

    def verdict(self) -> None:
        self.after_verdict = True

    def next_attempt(self) -> None:
        self.after_verdict = False

    def shown(self, text: str) -> bool:
        if is_noise(text, self.after_verdict):
            self.left_out += 1
            return False
        return True
