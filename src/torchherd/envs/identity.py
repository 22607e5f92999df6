"""What environment the nodes should have, and its hash.

Three sources, in this order: a ``uv.lock`` (exported by uv to pinned requirements), a
requirements file whose every line pins one version (``name==version``, markers allowed), or,
with neither, the launcher's own environment (every installed distribution and version, as this
interpreter sees them). The hash is ``agent.envid.identity``, the same function a node runs on
what it has, so "the lock's hash" and "node2's hash" are comparable.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..agent.envid import canonical, identity, this_environment
from ..errors import ConfigError

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*===?\s*([^\s;#]+)\s*(;[^#]*)?")


@dataclass(frozen=True)
class EnvTarget:
    """The environment every node should have: pinned packages for one Python minor version."""

    packages: dict[str, str]
    """canonical name -> version (with its local label, ``2.13.0+cpu``)."""
    python_version: str
    source: str
    """Where it came from, in words (``requirements.txt``, ``this environment``)."""
    local_projects: dict[str, Path] = field(default_factory=dict)
    """Projects installed from a folder on the launcher (editable or not): built into a wheel
    here, so the nodes run the same code."""

    @property
    def hash(self) -> str:
        return identity(self.packages, self.python_version)


def differences(want: dict[str, str], have: dict[str, str]) -> list[str]:
    """What a node must change to match: ``name have -> want`` lines, sorted by name."""
    lines = []
    for name in sorted(set(want) | set(have)):
        old, new = have.get(name), want.get(name)
        if old == new:
            continue
        lines.append(f"{name} {old or '(missing)'} -> {new or '(remove)'}")
    return lines


def from_requirements(path: Path, python_version: str | None = None) -> EnvTarget:
    """A requirements file where every requirement pins one version. Markers are kept out of
    the identity: a line whose marker is false for the nodes' Python is dropped (evaluated with
    ``packaging`` for that Python; other marker variables as on Linux)."""
    version = python_version or ".".join(str(v) for v in sys.version_info[:3])
    packages: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#") or line.startswith("--hash"):
            continue
        if line.startswith("-"):
            continue  # --index-url and such: the wheels come from the launcher, not an index
        match = _PIN.match(line.rstrip("\\").strip())
        if not match:
            raise ConfigError(
                f"{path}:{number}: {line!r} does not pin one version",
                remedy="pin every requirement (name==version), e.g. with `uv pip compile` or "
                "`pip freeze`, or name a uv.lock",
            )
        name, _extras, pinned, marker = match.groups()
        if marker and not _marker_holds(marker.lstrip(";").strip(), version):
            continue
        packages[canonical(name)] = pinned
    return EnvTarget(packages, version, source=str(path))


def from_uv_lock(path: Path, python_version: str | None = None) -> EnvTarget:
    """A uv.lock, exported by uv to pinned requirements (without the project itself)."""
    from .uvbin import uv_binary

    try:
        exported = subprocess.run(
            [
                uv_binary(),
                "export",
                "--frozen",
                "--no-hashes",
                "--no-header",
                "--no-emit-project",
                "--format",
                "requirements-txt",
            ],
            cwd=path.parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except subprocess.CalledProcessError as exc:
        raise ConfigError(
            f"{path}: uv could not export the lock: {exc.stderr.strip().splitlines()[-1:]}",
            remedy="run `uv lock` in that folder, then try again",
        ) from exc
    export = path.parent / ".herd-uv-export.txt"
    export.write_text(exported)
    try:
        target = from_requirements(export, python_version)
    finally:
        export.unlink()
    return EnvTarget(target.packages, target.python_version, source=str(path))


def from_this_environment() -> EnvTarget:
    """The launcher's own environment: what this interpreter has installed."""
    env = this_environment()
    packages = dict(env["packages"])  # type: ignore[call-overload]
    return EnvTarget(
        packages,
        str(env["python_version"]),
        source=f"this environment ({sys.prefix})",
        local_projects=_local_projects(packages),
    )


def choose(lock: Path | None, project: Path) -> EnvTarget:
    """The target the user means: ``lock`` when given, else ``uv.lock`` in ``project``, else
    this environment."""
    if lock is not None:
        if not lock.is_file():
            raise ConfigError(f"{lock}: no such file", remedy="name a uv.lock or requirements file")
        return from_uv_lock(lock) if lock.name == "uv.lock" else from_requirements(lock)
    if (project / "uv.lock").is_file():
        return from_uv_lock(project / "uv.lock")
    return from_this_environment()


def _local_projects(packages: dict[str, str]) -> dict[str, Path]:
    """Distributions installed from a local folder (PEP 610 ``direct_url.json`` with a
    ``file://`` URL and no archive): the user's own project, usually editable."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    found: dict[str, Path] = {}
    for dist in importlib.metadata.distributions():
        text = dist.read_text("direct_url.json")
        if not text:
            continue
        try:
            data = json.loads(text)
        except ValueError:
            continue
        url = data.get("url", "")
        if not url.startswith("file://") or "archive_info" in data:
            continue
        name = canonical(dist.metadata["Name"] or "")
        if name in packages:
            found[name] = Path(unquote(urlparse(url).path))
    return found


def _marker_holds(marker: str, python_version: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # pragma: no cover - packaging comes with pip and most environments
        raise ConfigError(
            f"a requirement has a marker ({marker}) and `packaging` is not installed",
            remedy="pip install packaging",
        ) from None
    minor = ".".join(python_version.split(".")[:2])
    return Marker(marker).evaluate(
        {
            "python_version": minor,
            "python_full_version": python_version,
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
        }
    )
