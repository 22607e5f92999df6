"""A worker that fails inside torch's ``@record`` (the documented way to hand the real exception
to the launcher): the summary shows the exception line and the traceback as a person reads
them, never torch's error-file JSON with the traceback squashed onto one line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.herd_cli import herd
from torchherd.logs import render_summary
from torchherd.results import Failure, RunResult

SCRIPT = """\
import os
from torch.distributed.elastic.multiprocessing.errors import record

def helper(x):
    raise ValueError(f"bad value {x} on rank {os.environ['RANK']}")

@record
def main():
    if os.environ["RANK"] == "1":
        helper(42)

if __name__ == "__main__":
    main()
"""


def test_a_recorded_exception_reads_as_python_printed_it(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(SCRIPT)
    run = herd(["launch", "--nproc", "2", "fail.py"], tmp_path / "home", tmp_path, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout[run.stdout.index("first failure:") :]
    assert summary.startswith("first failure: localhost rank 1: exit code 1\n")
    assert "\n  ValueError: bad value 42 on rank 1\n" in summary
    assert '"extraInfo"' not in run.stdout and "py_callstack" not in run.stdout
    assert "'message':" not in run.stdout  # torchrun's line is not a Python dict either
    assert "workers failed: ValueError: bad value 42 on rank 1" in run.stdout
    # the traceback, one frame per line, ending at the raise
    assert 'File "' in summary and "in helper" in summary
    assert "\\n" not in summary


def test_a_summary_given_torchs_error_json_shows_its_traceback() -> None:
    # A failure recorded by an older agent, or read from torch's error file as is.
    error = {
        "message": "ValueError: bad value",
        "extraInfo": {
            "py_callstack": 'Traceback (most recent call last):\n  File "t.py", line 5, in '
            'helper\n    raise ValueError("bad value")\nValueError: bad value\n',
            "timestamp": "1795397212",
        },
    }
    failure = Failure("gpu2", 3, 1, None, json.dumps(error), last_stderr=("noise",))
    text = render_summary(RunResult("j", 1, {"gpu2": "failed"}, failure))
    assert "\n  ValueError: bad value\n" in text
    assert '      File "t.py", line 5, in helper\n        raise ValueError("bad value")' in text
    assert "extraInfo" not in text
