"""herd env: the environment's hash, lock parsing, wheel choice per platform, and the node
side run for real on this machine (uv installs real wheels into a real folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wheels import make_wheel
from torchherd.agent import envid, envnode
from torchherd.envs.identity import differences, from_requirements, from_this_environment
from torchherd.envs.resolve import Platform, fits, parse_wheel, resolve
from torchherd.envs.uvbin import uv_binary, uv_version
from torchherd.errors import ConfigError

X86 = Platform("x86_64", "2.36", "cp311")
ARM = Platform("aarch64", "2.36", "cp311")


def test_hash_depends_on_versions_and_python_minor_only() -> None:
    base = envid.identity({"torch": "2.13.0+cpu", "numpy": "2.1.0"}, "3.11.7")
    assert base == envid.identity({"Numpy": "2.1.0", "torch": "2.13.0+cpu"}, "3.11.2")
    assert base != envid.identity({"torch": "2.13.0+cu128", "numpy": "2.1.0"}, "3.11.7")
    assert base != envid.identity({"torch": "2.13.0+cpu", "numpy": "2.1.0"}, "3.12.0")
    assert len(base) == envid.HASH_LENGTH


def test_launcher_environment_hash_is_what_its_python_computes_on_itself() -> None:
    target = from_this_environment()
    out = subprocess.run(
        [sys.executable, envid.__file__], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout)["hash"] == target.hash
    assert "torchherd" in target.local_projects  # installed editable from this tree


def test_requirements_pins_markers_and_mistakes(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text(
        "# pinned\nTyping_Extensions==4.12.2\nfoo==1.0 ; python_version < '3.9'\n"
        "--index-url https://example.invalid\nbar[x]==2.0  # c\n"
    )
    target = from_requirements(req, "3.11.7")
    assert target.packages == {"typing-extensions": "4.12.2", "bar": "2.0"}
    req.write_text("numpy>=1\n")
    with pytest.raises(ConfigError, match=r"requirements.txt:1: 'numpy>=1' does not pin"):
        from_requirements(req)


def test_differences_name_every_change() -> None:
    assert differences({"a": "1", "b": "2"}, {"a": "1", "b": "1", "c": "3"}) == [
        "b 1 -> 2",
        "c 3 -> (remove)",
    ]


def test_wheel_fits_its_own_platform_only() -> None:
    many = parse_wheel("torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl")
    assert many is not None and fits(many, ARM) and not fits(many, X86)
    assert not fits(many, Platform("aarch64", "2.17", "cp311"))  # glibc too old
    pure = parse_wheel("six-1.16.0-py2.py3-none-any.whl")
    assert pure is not None and fits(pure, X86) and fits(pure, ARM)
    other_py = parse_wheel("numpy-2.1.0-cp312-cp312-manylinux2014_x86_64.whl")
    assert other_py is not None and not fits(other_py, X86)


def test_resolve_takes_each_platforms_wheel_and_names_a_missing_one(tmp_path: Path) -> None:
    make_wheel(tmp_path, "fast", "1.0", platform="linux_x86_64", python="cp311", abi="cp311")
    make_wheel(tmp_path, "fast", "1.0", platform="linux_aarch64", python="cp311", abi="cp311")
    make_wheel(tmp_path, "pure", "2.0")
    req = tmp_path / "req.txt"
    req.write_text("fast==1.0\npure==2.0\n")
    target = from_requirements(req, "3.11.7")
    x86 = resolve(target, X86, [tmp_path], fetch=False)
    arm = resolve(target, ARM, [tmp_path], fetch=False)
    assert x86["fast"].name.endswith("linux_x86_64.whl")
    assert arm["fast"].name.endswith("linux_aarch64.whl")
    assert x86["pure"] == arm["pure"]
    with pytest.raises(ConfigError, match=r"no wheel for cp311 linux riscv64.*fast==1.0"):
        resolve(target, Platform("riscv64", "2.36", "cp311"), [tmp_path], fetch=False)


def _node(action: str, root: Path, stdin: bytes = b"", **args: object) -> list[dict]:
    """Run the node side exactly as a node does: python3 -c BOOTSTRAP, modules on stdin, which
    stays open until the node side is done (as the launcher holds it during a build)."""
    sources = {
        "envid": Path(envid.__file__).read_text(),
        "envnode": Path(envnode.__file__).read_text(),
    }
    argv = [
        sys.executable,
        "-c",
        envnode.BOOTSTRAP,
        action,
        json.dumps({"root": str(root), **args}),
    ]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as node:
        assert node.stdin is not None and node.stdout is not None
        node.stdin.write((json.dumps(sources) + "\n").encode() + stdin)
        node.stdin.flush()
        if action != "build":
            node.stdin.close()
        out = node.stdout.read()
        if not node.stdin.closed:
            node.stdin.close()
    return [json.loads(line) for line in out.decode().splitlines()]


def _tar(files: dict[str, Path]) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, path in files.items():
            tar.add(path, arcname=name)
    return buffer.getvalue()


def test_node_side_builds_verifies_switches_and_goes_back(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    a1, b1 = make_wheel(wheels, "alpha", "1.0"), make_wheel(wheels, "beta", "1.0")
    a2 = make_wheel(wheels, "alpha", "2.0")
    root = tmp_path / "node"
    uv = {f"uv-{uv_version()}": Path(uv_binary())}
    got = _node("receive", root, _tar({a1.name: a1, b1.name: b1, **uv}))
    assert got[-1] == {"done": {"received": 3}}
    python = f"{sys.version_info[0]}.{sys.version_info[1]}.0"
    first = envid.identity({"alpha": "1.0", "beta": "1.0"}, python)
    got = _node("build", root, hash=first, wheels=[a1.name, b1.name], uv=uv_version())
    assert got[-1] == {"done": {"current": first}}, got
    env_python = root / "current" / "bin" / "python"
    said = subprocess.run(
        [env_python, "-c", "import alpha; print(alpha.VERSION)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert said.strip() == "1.0"
    # A second environment is built beside the first; the first stays whole.
    _node("receive", root, _tar({a2.name: a2}))
    second = envid.identity({"alpha": "2.0", "beta": "1.0"}, python)
    assert _node("build", root, hash=second, wheels=[a2.name, b1.name], uv=uv_version())[-1] == {
        "done": {"current": second}
    }
    assert os.readlink(root / "current") == second
    # The cached beta wheel's files were hardlinked, not copied, into both environments.
    seen = _node("look", root)[-1]["done"]
    assert seen["envs"][first]["complete"] and seen["envs"][second]["complete"]
    assert seen["envs"][second]["hash"] == second
    betas = [
        next((root / h).glob("lib/python*/site-packages/beta/__init__.py")) for h in (first, second)
    ]
    assert betas[0].stat().st_ino == betas[1].stat().st_ino
    # Going back is a switch; the current one cannot be removed.
    assert _node("use", root, hash=first)[-1] == {"done": {"current": first}}
    assert "current environment" in _node("rm", root, hash=first)[-1]["error"]
    assert _node("rm", root, hash=second)[-1] == {"done": {"removed": True}}


def test_node_side_refuses_a_build_whose_hash_does_not_check_out(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    a1 = make_wheel(wheels, "alpha", "1.0")
    root = tmp_path / "node"
    _node("receive", root, _tar({a1.name: a1, f"uv-{uv_version()}": Path(uv_binary())}))
    got = _node("build", root, hash="0" * envid.HASH_LENGTH, wheels=[a1.name], uv=uv_version())
    assert "hashes to" in got[-1]["error"]
    assert not (root / "current").exists()
    seen = _node("look", root)[-1]["done"]
    assert seen["envs"]["0" * envid.HASH_LENGTH]["complete"] is False


def test_doctor_names_the_node_whose_environment_differs_and_its_packages() -> None:
    from torchherd.facts import NodeFacts
    from torchherd.preflight import Findings, Status
    from torchherd.preflight.environment import environment
    from torchherd.spec import parse_host_list

    same = {"torch": "2.13.0+cpu", "numpy": "2.1.0"}
    odd = {"torch": "2.13.0+cpu", "numpy": "2.2.0", "rich": "13.0"}
    facts = {
        host: NodeFacts(host, env_hash=envid.identity(pkgs, "3.11.7"), extra={"env_packages": pkgs})
        for host, pkgs in (("a", same), ("b", odd), ("c", same))
    }
    findings = Findings(cluster=parse_host_list("a,b,c", source="-H"), facts=facts, full_probe=True)
    results = {r.host: r for r in environment(findings)}
    assert results["a"].status is Status.PASS and results["c"].status is Status.PASS
    assert results["b"].status is Status.FAIL
    assert "numpy 2.1.0 -> 2.2.0" in results["b"].summary
    assert "rich (missing) -> 13.0" in results["b"].summary
    assert "herd env sync" in results["b"].remedy
