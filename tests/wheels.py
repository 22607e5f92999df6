"""Small real wheels made on the spot (no network, no build backend): a pure-Python package
``NAME`` of ``VERSION`` whose module says its version, for the ``herd env`` tests."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(
    folder: Path,
    name: str,
    version: str,
    platform: str = "any",
    python: str = "py3",
    abi: str = "none",
    payload: int = 0,
    modules: int = 0,
    extra: dict[str, str] | None = None,
    package: bool = True,
) -> Path:
    """Write ``NAME-VERSION-PY-ABI-PLATFORM.whl`` into ``folder``; ``payload`` extra bytes of
    data make it as large as a test needs, ``modules`` extra small modules as slow to install,
    ``extra`` more files by path (a ``.pth`` file at the top, say); without ``package`` the
    wheel holds no module of its name."""
    folder.mkdir(parents=True, exist_ok=True)
    module = name.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
            f"Tag: {python}-{abi}-{platform}\n"
        ),
    }
    if payload:
        files[f"{module}/data.bin"] = "x" * payload
    for k in range(modules):
        files[f"{module}/part{k}.py"] = f"K = {k}\n"
    files.update(extra or {})
    if not package:
        del files[f"{module}/__init__.py"]
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{module}-{version}-{python}-{abi}-{platform}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel
