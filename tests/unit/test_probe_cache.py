"""The probe's torch cache, through the real `herd doctor` on this machine: a second run reuses
the first one's torch import, `--fresh` imports again, and a change to the torch install (a
CUDA library wheel added beside it) imports again. The cache directory is private (0700).

The interpreter is a venv of its own whose torch is this suite's torch, reached through a
symlink in the venv's site-packages: the install's folder is then the venv's to change, as a
`pip install nvidia-...` would, without touching the suite's own torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torchherd

SRC = Path(torchherd.__file__).resolve().parents[1]


@pytest.fixture
def python(tmp_path: Path) -> Path:
    """A venv whose site-packages holds torch (a symlink to this suite's), then this source
    tree and this suite's other packages after it."""
    torch = importlib.util.find_spec("torch")
    assert torch is not None and torch.origin, "this suite's interpreter has no torch"
    suite_packages = Path(torch.origin).parents[1]
    root = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60
    )
    packages = next(root.glob("lib/python3*/site-packages"))
    (packages / "torch").symlink_to(Path(torch.origin).parent, target_is_directory=True)
    (packages / "herd-suite.pth").write_text(f"{SRC}\n{suite_packages}\n")
    return root / "bin" / "python"


def doctor(python: Path, cwd: Path, *args: str, **env: str) -> dict[str, Any]:
    """`herd doctor --json` on this machine alone, run by ``python``; this machine's facts."""
    done = subprocess.run(
        [str(python), "-m", "torchherd", "doctor", "--json", *args],
        cwd=cwd,
        env={**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 3), done.stdout + done.stderr
    facts = json.loads(done.stdout)["facts"]
    (only,) = facts.values()
    assert only["torch"]["ok"], only["torch"]
    assert Path(only["python"]) == python, only["python"]  # run by that interpreter
    return dict(only["torch"])


def test_torch_import_is_remembered_per_install_and_fresh_forces_it(
    python: Path, tmp_path: Path
) -> None:
    os.umask(0o022)  # the usual umask, which herd must not rely on
    cache = tmp_path / "cache"
    (cache / "torchherd").mkdir(parents=True, mode=0o755)  # left wider by an older version
    env = {"XDG_CACHE_HOME": str(cache), "HERD_HOME": str(tmp_path / "home")}
    assert "cached" not in doctor(python, tmp_path, **env)  # imported: nothing remembered yet
    assert stat.S_IMODE((cache / "torchherd").stat().st_mode) == 0o700
    (entry,) = (cache / "torchherd").iterdir()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600

    assert doctor(python, tmp_path, **env)["cached"] is True  # the same install: remembered
    assert "cached" not in doctor(python, tmp_path, "--fresh", **env)  # forced

    # The install changes: a CUDA library wheel lands beside torch (site-packages/nvidia).
    library = python.parents[1].glob("lib/python3*/site-packages")
    nvidia = next(library) / "nvidia" / "nccl" / "lib"
    nvidia.mkdir(parents=True)
    (nvidia / "libnccl.so.2").write_bytes(b"\0" * 64)
    assert "cached" not in doctor(python, tmp_path, **env)
    assert doctor(python, tmp_path, **env)["cached"] is True
    # What torch would see changes too: CUDA_VISIBLE_DEVICES set, even empty (no GPU visible),
    # is not the same as unset (every GPU visible).
    assert "cached" not in doctor(python, tmp_path, CUDA_VISIBLE_DEVICES="", **env)
    assert doctor(python, tmp_path, CUDA_VISIBLE_DEVICES="", **env)["cached"] is True
