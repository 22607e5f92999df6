"""The wheels of one environment for one node platform, found on the launcher.

A node's platform is what its own interpreter reports (machine, glibc, ``cpXY``), never the
launcher's: an x86 login node in front of aarch64 nodes resolves aarch64 wheels. Wheels come
from the folders the user names (``--wheels DIR``), then from herd's wheel cache on the launcher
(``~/.herd/wheels``, or ``$HERD_HOME/wheels``), and what neither holds is fetched once with
``pip download`` for that platform into the cache; a pin no wheel of that platform satisfies
is named, with its platform. The user's own projects installed from a folder are built into a
wheel once per version.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..agent.envid import canonical
from ..errors import ConfigError
from .identity import EnvTarget


def launcher_cache() -> Path:
    """herd's wheel cache on the launcher: ``~/.herd/wheels`` (``$HERD_HOME/wheels``)."""
    from ..records import herd_home

    return herd_home() / "wheels"


@dataclass(frozen=True)
class Platform:
    """What a node can install: its machine, C library and interpreter."""

    machine: str
    glibc: str | None
    python_tag: str

    def describe(self) -> str:
        return f"{self.python_tag} linux {self.machine}" + (
            f" glibc {self.glibc}" if self.glibc else ""
        )


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    tags: tuple[str, str, str]
    """python, abi, platform (each may hold several, dot-separated)."""


def parse_wheel(filename: str) -> Wheel | None:
    parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        return None
    return Wheel(canonical(parts[0]), parts[1], (parts[-3], parts[-2], parts[-1]))


def fits(wheel: Wheel, platform: Platform) -> bool:
    """Whether ``platform`` can install ``wheel`` (its tags, as pip would judge them)."""
    py, abi, plat = wheel.tags
    minor = platform.python_tag[3:] if platform.python_tag.startswith("cp3") else ""
    py_ok = any(
        tag in (platform.python_tag, "py3", f"py3{minor}")
        or (
            tag.startswith("cp3")
            and abi.split(".") == ["abi3"]
            and tag[3:].isdigit()
            and minor.isdigit()
            and int(tag[3:]) <= int(minor)
        )
        for tag in py.split(".")
    )
    abi_ok = any(tag in ("none", "abi3", platform.python_tag) for tag in abi.split("."))
    return py_ok and abi_ok and any(_platform_fits(tag, platform) for tag in plat.split("."))


def _platform_fits(tag: str, platform: Platform) -> bool:
    if tag == "any":
        return True
    if tag == f"linux_{platform.machine}":
        return True
    found = re.fullmatch(r"manylinux_(\d+)_(\d+)_(.+)", tag)
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    if found:
        need, arch = (int(found[1]), int(found[2])), found[3]
    else:
        head, _, arch = tag.partition("_")
        if head not in legacy:
            return False
        need = legacy[head]
    if arch != platform.machine or not platform.glibc:
        return False
    have = tuple(int(x) for x in platform.glibc.split(".")[:2])
    return have >= need


def resolve(
    target: EnvTarget, platform: Platform, folders: list[Path], fetch: bool = True
) -> dict[str, Path]:
    """canonical name -> the wheel file for ``platform``, for every package of ``target``."""
    cache = launcher_cache()
    found: dict[str, Path] = {}
    missing: list[str] = []
    pool = [*folders, cache]
    for name, version in sorted(target.packages.items()):
        if name in target.local_projects:
            found[name] = _local_wheel(name, version, target.local_projects[name], cache)
            continue
        wheel = _look(pool, name, version, platform)
        if wheel is None:
            missing.append(name)
        else:
            found[name] = wheel
    if missing and fetch:
        _download([f"{n}=={target.packages[n]}" for n in missing], platform, cache)
        for name in list(missing):
            wheel = _look([cache], name, target.packages[name], platform)
            if wheel is not None:
                found[name] = wheel
                missing.remove(name)
    if missing:
        pins = ", ".join(f"{n}=={target.packages[n]}" for n in missing)
        raise ConfigError(
            f"no wheel for {platform.describe()} of {pins}",
            remedy="put wheels for that platform in a folder and name it with --wheels DIR "
            "(e.g. `pip download --only-binary=:all: --platform ... -d DIR`), or pin a version "
            "that publishes one",
        )
    return found


def _look(folders: list[Path], name: str, version: str, platform: Platform) -> Path | None:
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.whl")):
            wheel = parse_wheel(path.name)
            if wheel and wheel.name == name and wheel.version == version and fits(wheel, platform):
                return path
    return None


def _download(pins: list[str], platform: Platform, cache: Path) -> None:
    """Fetch wheels for ``platform`` into the launcher's cache, once (pip's own cache helps)."""
    cache.mkdir(parents=True, exist_ok=True)
    minor = platform.python_tag[2:]
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        minor,
        "--implementation",
        "cp",
        "-d",
        str(cache),
    ]
    for tag in _platform_tags(platform):
        argv += ["--platform", tag]
    done = subprocess.run([*argv, *pins], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        # One by one, so the pins that can be had are had and the rest are named after.
        for pin in pins:
            subprocess.run([*argv, pin], capture_output=True, text=True, check=False)


def _platform_tags(platform: Platform) -> list[str]:
    """pip's ``--platform`` values for a node: every manylinux its glibc runs, newest first
    (pip does not widen ``manylinux_2_X`` to older ones by itself, and torch publishes only
    ``manylinux_2_28`` wheels, which ``manylinux2014`` alone would refuse), and ``linux_*``."""
    machine = platform.machine
    tags = []
    if platform.glibc and platform.glibc.replace(".", "").isdigit():
        major, minor = (int(x) for x in platform.glibc.split(".")[:2])
        if major == 2:
            tags += [f"manylinux_2_{m}_{machine}" for m in range(minor, 16, -1)]
    return [*tags, f"manylinux2014_{machine}", f"linux_{machine}"]


def _local_wheel(name: str, version: str, project: Path, cache: Path) -> Path:
    """The user's own project (installed from ``project``) as a wheel, built once per version
    (a build of a changed tree with the same version is rebuilt: its files are compared)."""
    out = cache / "local" / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()  # the tree may have changed since: always build (it is small and fast)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(project),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    wheels = list(out.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConfigError(
            f"could not build a wheel of {name} from {project}: "
            f"{done.stderr.strip().splitlines()[-1:]}",
            remedy=f"run `pip wheel --no-deps {project}` to see why",
        )
    return wheels[0]
