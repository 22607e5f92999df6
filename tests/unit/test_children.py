"""The launcher's children are waited for without a thread each (transport/children.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_children_are_waited_for_without_a_thread_each() -> None:
    # In a fresh interpreter: the watcher is process-wide.
    probe = textwrap.dedent(
        """
        import asyncio, threading
        from torchherd.transport.children import wait_for_children_with_pidfds
        wait_for_children_with_pidfds()

        async def main():
            children = [await asyncio.create_subprocess_exec("sleep", "1") for _ in range(20)]
            during = threading.active_count()
            codes = await asyncio.gather(*(c.wait() for c in children))
            print(during, sorted(set(codes)))

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    threads, codes = done.stdout.split(" ", 1)
    assert int(threads) < 5, done.stdout  # a thread per child would make it 21 or more
    assert codes.strip() == "[0]"
