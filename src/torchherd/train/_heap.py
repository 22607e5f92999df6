"""Python's garbage collector while the Trainer trains: what the model, the optimizer and the
compiled code hold is frozen once they exist, so the collector's full passes stop walking it.

A full pass walks every object the process tracks. After torch.compile that is a great many
(dynamo's and inductor's caches): on an H200, examples/gpt.py compiled paused 0.29-0.37 s in
each of its full passes, several in 180 steps, each at a moment its rank chose alone (under DDP
every other rank waits for it). ``gc.freeze()`` moves every object alive at that moment to a
generation the collector never walks. It is called right after a collection (so no garbage is
frozen), after the first step (the compiled code exists by then) and after a step that
evaluated or saved (an evaluation compiles graphs of its own). Automatic collection stays on:
garbage still goes as it did, and its passes are short. At the end of ``fit`` the objects are
unfrozen again, unless the script had frozen some itself (then it owns the frozen set).
"""

from __future__ import annotations

import gc


class FrozenHeap:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._owner = enabled and gc.get_freeze_count() == 0
        self.freezes = 0
        """How often the heap was frozen (for tests and the curious)."""

    def settle(self) -> None:
        """Collect, then freeze what is alive: the collector's later passes skip it."""
        if self.enabled:
            gc.collect()
            gc.freeze()
            self.freezes += 1

    def close(self) -> None:
        """Leave the interpreter's collector as fit found it."""
        if self.enabled and self._owner:
            gc.unfreeze()
