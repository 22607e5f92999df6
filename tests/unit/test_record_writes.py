"""job.json has one writer at a time, and a file replaced from two threads at once is never
torn: write_private's temporary file is its own per thread. Real files, real threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from torchherd.files import write_private


def test_threads_replacing_one_file_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "job.json"
    errors: list[BaseException] = []
    texts = {n: json.dumps({"writer": n, "pad": "x" * 20_000}) for n in range(6)}

    def write(n: int) -> None:
        try:
            for _ in range(150):
                write_private(target, texts[n])
        except BaseException as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert target.read_text() in texts.values()
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]  # no temporary left behind
