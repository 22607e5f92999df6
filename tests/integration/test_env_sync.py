"""`herd env` on real nodes: each testbed node has its own filesystem at ``bed.private`` (a
mount namespace), so an environment built there exists on that node only, as on separate
machines. Nodes start with nothing but python3; the wheels are small ones made on the spot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import torchherd
from tests.integration.conftest import require_testbed
from tests.integration.herd_cli import herd
from tests.testbed import Testbed
from tests.wheels import make_wheel
from torchherd.agent import envid

# Its own testbed: one process of the suite runs the whole module. (Its Ctrl-C lands once a
# node says it installs a 20,000-module package, which takes seconds even on an idle machine.)
pytestmark = pytest.mark.xdist_group("env_sync")

PY = f"{sys.version_info[0]}.{sys.version_info[1]}.0"


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    require_testbed()
    with Testbed(3, hosts_loopback=False, private_dirs=True) as testbed:
        yield testbed


@pytest.fixture(scope="module")
def work(bed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("env")
    bed.write_cluster_file(work / "herd.toml")
    wheels = work / "wheels"
    make_wheel(wheels, "alpha", "1.0")
    make_wheel(wheels, "alpha", "2.0")
    make_wheel(wheels, "beta", "1.0", payload=300_000)
    (work / "v1.txt").write_text("alpha==1.0\nbeta==1.0\n")
    (work / "v2.txt").write_text("alpha==2.0\nbeta==1.0\n")
    return work


def env(bed: Testbed, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    root = f"{bed.private}/herd"
    return herd(
        ["env", *args, "-c", str(work / "herd.toml"), "--root", root],
        work / "home",
        work,
        timeout=240,
    )


def sync(bed: Testbed, work: Path, lock: str, *extra: str) -> tuple[int, dict]:
    done = env(
        bed, work, "sync", "--lock", lock, "--wheels", str(work / "wheels"), "--json", *extra
    )
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout)


def current(bed: Testbed, node: str) -> str:
    return os.readlink(bed.private_of(node) / "herd" / "current")


def test_fresh_nodes_end_identical_and_run_the_synced_python(bed: Testbed, work: Path) -> None:
    code, out = sync(bed, work, "v1.txt")
    want = envid.identity({"alpha": "1.0", "beta": "1.0"}, PY)
    assert code == 0, out
    assert out["hash"] == want
    for node in out["nodes"]:
        assert (node["state"], node["after"], node["before"]) == ("synced", want, None), node
        assert node["files_sent"] == 3  # two wheels and uv itself
    for test_node in bed.nodes:
        # Built on the node's own filesystem, and its python imports the synced code there.
        assert (bed.private_of(test_node) / "herd" / want / ".herd-complete").is_file()
        said = bed.ns_run(
            test_node,
            [
                f"{bed.private}/herd/current/bin/python",
                "-c",
                "import alpha, sys; print(alpha.VERSION, sys.prefix)",
            ],
        )
        assert said.stdout.split()[0] == "1.0"
    assert not (bed.private / "herd").exists()  # nothing on the launcher's own filesystem
    status = env(bed, work, "status", "--lock", "v1.txt", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    # Nothing changed: nothing travels, nothing is built.
    code, out = sync(bed, work, "v1.txt")
    assert code == 0 and {n["state"] for n in out["nodes"]} == {"same"}
    assert sum(n["bytes_sent"] for n in out["nodes"]) == 0


def test_one_changed_package_moves_alone_and_going_back_is_instant(
    bed: Testbed, work: Path
) -> None:
    old = envid.identity({"alpha": "1.0", "beta": "1.0"}, PY)
    sync(bed, work, "v1.txt")
    code, out = sync(bed, work, "v2.txt")
    new = envid.identity({"alpha": "2.0", "beta": "1.0"}, PY)
    assert code == 0, out
    alpha2 = (work / "wheels" / "alpha-2.0-py3-none-any.whl").stat().st_size
    for node in out["nodes"]:
        assert node["files_sent"] == 1 and alpha2 < node["bytes_sent"] < alpha2 + 4096, node
        assert node["changes"] == ["alpha 1.0 -> 2.0"]
        assert node["after"] == new
    used = env(bed, work, "use", old)
    assert used.returncode == 0, used.stdout + used.stderr
    assert {current(bed, n.name) for n in bed.nodes} == {old}
    removed = env(bed, work, "rm", new, "--json")
    assert removed.returncode == 0
    assert not (bed.private_of("node1") / "herd" / new).exists()


def test_a_node_changed_by_hand_is_named_and_repaired(bed: Testbed, work: Path) -> None:
    want = envid.identity({"alpha": "1.0", "beta": "1.0"}, PY)
    sync(bed, work, "v1.txt")
    site = next((bed.private_of("node2") / "herd" / want).glob("lib/python*/site-packages"))
    for path in site.glob("beta*"):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    status = env(bed, work, "status", "--lock", "v1.txt")
    assert status.returncode == 3
    assert "node2: beta (missing) -> 1.0" in status.stdout
    assert "node1:" not in status.stdout
    assert "fix: herd env sync --lock v1.txt" in status.stderr and "--nodes node2" in status.stderr
    code, out = sync(bed, work, "v1.txt")
    states = {n["host"]: n["state"] for n in out["nodes"]}
    assert code == 0 and states == {"node1": "same", "node2": "synced", "node3": "same"}
    assert env(bed, work, "status", "--lock", "v1.txt").returncode == 0


def test_ctrl_c_mid_sync_leaves_the_previous_environment(bed: Testbed, work: Path) -> None:
    old = envid.identity({"alpha": "1.0", "beta": "1.0"}, PY)
    sync(bed, work, "v1.txt")
    # A large new package: the install takes long enough to be interrupted in.
    make_wheel(work / "wheels", "gamma", "1.0", payload=20_000_000, modules=20_000)
    (work / "v3.txt").write_text("alpha==1.0\nbeta==1.0\ngamma==1.0\n")
    argv = [
        sys.executable,
        "-m",
        "torchherd",
        "env",
        "sync",
        "--lock",
        "v3.txt",
        "--wheels",
        str(work / "wheels"),
        "-c",
        str(work / "herd.toml"),
        "--root",
        f"{bed.private}/herd",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HERD_HOME=str(work / "home")),
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.rstrip().endswith(": install"):  # a node is building; none has switched
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + err
    assert "keeps its previous one" in err
    # Whatever a node still had running must end, not finish the build and switch later.
    deadline = time.monotonic() + 60
    while any(bed.node_processes(n) for n in bed.nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(bed.node_processes(n) for n in bed.nodes)
    for node in bed.nodes:
        assert current(bed, node.name) == old
        said = bed.ns_run(
            node,
            [f"{bed.private}/herd/current/bin/python", "-c", "import alpha; print(alpha.VERSION)"],
        )
        assert said.stdout.strip() == "1.0"
        assert not list((bed.private_of(node) / "herd" / "cache" / "wheels").glob("*.part-*"))


def test_a_full_disk_is_named_before_anything_is_written(bed: Testbed, work: Path) -> None:
    fresh = f"{bed.private}/small"
    bed.ns_run("node3", ["mkdir", "-p", fresh])
    bed.ns_run("node3", ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", fresh])
    try:
        done = herd(
            [
                "env",
                "sync",
                "--lock",
                "v1.txt",
                "--wheels",
                str(work / "wheels"),
                "-c",
                str(work / "herd.toml"),
                "--root",
                f"{fresh}/herd",
            ],
            work / "home",
            work,
            timeout=240,
        )
        assert done.returncode == 3, done.stdout + done.stderr
        assert "node3: disk space: needs" in done.stdout and "nothing was written" in done.stdout
        assert "node1: not started: other nodes lack disk space" in done.stdout
        listed = bed.ns_run("node3", ["ls", "-A", fresh]).stdout.split()
        assert listed == []
    finally:
        bed.ns_run("node3", ["umount", fresh], check=False)
    assert not (bed.private_of("node1") / "small").exists()


def test_a_node_without_the_interpreter_is_named_with_the_fix(bed: Testbed, work: Path) -> None:
    done = herd(
        [
            "env",
            "sync",
            "--lock",
            "v1.txt",
            "--wheels",
            str(work / "wheels"),
            "-c",
            str(work / "herd.toml"),
            "--root",
            f"{bed.private}/herd",
            "--nodes",
            "node1",
            "--node-python",
            "/opt/none/python3",
        ],
        work / "home",
        work,
    )
    assert done.returncode == 3
    assert "node1: no /opt/none/python3 on this node: install Python 3" in done.stdout


def test_another_platform_gets_its_own_wheels(bed: Testbed, work: Path) -> None:
    wheels = work / "wheels"
    for machine in ("x86_64", "aarch64"):
        make_wheel(wheels, "fast", "1.0", platform=f"linux_{machine}", python="cp311", abi="cp311")
    (work / "v4.txt").write_text("alpha==1.0\nfast==1.0\n")
    (bed.private_of("node3") / "herd").mkdir(exist_ok=True)
    (bed.private_of("node3") / "herd" / "platform").write_text("aarch64\n")
    try:
        code, out = sync(bed, work, "v4.txt")
    finally:
        (bed.private_of("node3") / "herd" / "platform").unlink()
    assert code == 0, out
    want = envid.identity({"alpha": "1.0", "fast": "1.0"}, PY)
    assert {n["after"] for n in out["nodes"]} == {want}
    platforms = {n["host"]: n["platform"] for n in out["nodes"]}
    assert "aarch64" in platforms["node3"] and "x86_64" in platforms["node1"]
    cache3 = {p.name for p in (bed.private_of("node3") / "herd" / "cache" / "wheels").iterdir()}
    cache1 = {p.name for p in (bed.private_of("node1") / "herd" / "cache" / "wheels").iterdir()}
    assert "fast-1.0-cp311-cp311-linux_aarch64.whl" in cache3
    assert "fast-1.0-cp311-cp311-linux_x86_64.whl" not in cache3
    assert "fast-1.0-cp311-cp311-linux_x86_64.whl" in cache1


RANK_SCRIPT = """\
import os, sys
import torch.distributed as dist
from torchherd.agent import envid
dist.init_process_group("gloo")
site = [p for p in sys.path if p.endswith("site-packages")]
print("env", dist.get_rank(), sys.executable, envid.this_environment(site)["hash"], flush=True)
# Every rank waits for the others before it leaves: a rank that exits right after its own
# init_process_group can close its end while a slower peer still forms the mesh (Gloo then
# fails that peer with "Connection closed by peer").
dist.barrier()
dist.destroy_process_group()
"""


def job_environment(work: Path) -> tuple[Path, str]:
    """A lock of what a job needs: torchherd (a wheel of this tree: herd's agent runs in the
    environment) and torch. Torch's own 190 MB wheel is not unpacked on every node here (three
    copies cost minutes of this machine's disk; bench/env_sync.py syncs the real wheels):
    the STAND-IN wheel ``torch`` of this suite's torch version holds only its metadata and a
    .pth file that puts this suite's own torch and what it imports on the path (from a folder
    of links without their metadata). Nodes, probes and ranks see torch of that version,
    installed by herd, and the environment's hash is that of the two wheels herd synced."""
    import importlib.metadata
    import importlib.util

    wheels = work / "job-wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(Path(__file__).parents[2])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    torch = importlib.util.find_spec("torch")
    assert torch is not None and torch.origin is not None
    site = Path(torch.origin).parents[1]
    imports = work / "suite-torch"
    imports.mkdir()
    for entry in site.iterdir():
        if not entry.name.endswith(
            (".dist-info", ".egg-info", ".pth")
        ) and not entry.name.startswith(("torchherd", "__editable__")):
            (imports / entry.name).symlink_to(entry)
    version = importlib.metadata.version("torch")
    make_wheel(wheels, "torch", version, extra={"suite_torch.pth": f"{imports}\n"}, package=False)
    pins = {"torchherd": torchherd.__version__, "torch": version}
    (work / "job.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    return wheels, envid.identity(pins, PY)


def test_launch_with_env_sync_syncs_only_the_nodes_that_differ(bed: Testbed, work: Path) -> None:
    wheels, want = job_environment(work)
    (work / "where_env.py").write_text(RANK_SCRIPT)
    root = f"{bed.private}/herd"
    cluster = bed.write_cluster_file(
        work / "launch.toml",
        nodes=[{"host": n.name, "nproc": 1} for n in bed.nodes],
        python=f"{root}/current/bin/python",
        workdir=str(work),
        env={"HERD_HOME": str(work / "home")},
        env_lock=str(work / "job.txt"),
        env_wheels=[str(wheels)],
        env_root=root,
    )

    def launch(*extra: str) -> subprocess.CompletedProcess[str]:
        return herd(["launch", "-c", str(cluster), *extra, "where_env.py"], work / "home", work,
                    timeout=300)  # fmt: skip

    def ranks_said(out: str) -> set[tuple[str, str]]:
        found = [line.split()[-2:] for line in out.splitlines() if " env " in f" {line}"]
        assert len(found) == 3, out
        return {(python, digest) for python, digest in found}

    # Fresh nodes (no environment of this lock anywhere): every node is synced first.
    done = launch("--env-sync")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"environment {want} ({work / 'job.txt'}) on every node" in done.stderr
    assert "synced before the start: node1, node2, node3" in done.stderr
    assert ranks_said(done.stdout) == {(f"{root}/{want}/bin/python", want)}
    # node3's environment is changed by hand: without the option the launch is refused
    # before any rank starts, naming node3 and the fix.
    site = next((bed.private_of("node3") / "herd" / want).glob("lib/python*/site-packages"))
    (site / "extra-1.0.dist-info").mkdir()
    (site / "extra-1.0.dist-info" / "METADATA").write_text("Name: extra\nVersion: 1.0\n")
    refused = launch()
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "node3: environment " in refused.stderr and f"{want} on node1, node2" in refused.stderr
    assert "herd launch --env-sync" in refused.stderr
    assert " env " not in refused.stdout  # no rank ran
    # With the option only node3 is synced (the others are not touched), then every rank
    # runs the same environment.
    before = {n: (bed.private_of(n) / "herd" / want).stat().st_mtime_ns for n in ("node1", "node2")}
    done = launch("--env-sync")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "synced before the start: node3 (" in done.stderr
    assert ranks_said(done.stdout) == {(f"{root}/{want}/bin/python", want)}
    assert not (site / "extra-1.0.dist-info").exists()
    after = {n: (bed.private_of(n) / "herd" / want).stat().st_mtime_ns for n in ("node1", "node2")}
    assert after == before
    # What herd recorded: the job ran that environment's python.
    records = sorted((work / "home" / "jobs").glob("*/job.json"), key=lambda p: p.stat().st_mtime)
    assert json.loads(records[-1].read_text())["cluster"]["python"] == f"{root}/{want}/bin/python"


def test_above_the_fan_out_threshold_nodes_pass_the_wheels_on(bed: Testbed, work: Path) -> None:
    root = f"{bed.private}/relayed"  # fresh on every node: each lacks the same three files
    done = herd(
        ["env", "sync", "--lock", "v1.txt", "--wheels", str(work / "wheels"), "--json",
         "-c", str(work / "herd.toml"), "--root", root, "--relay-above", "1"],
        work / "home", work, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    want = envid.identity({"alpha": "1.0", "beta": "1.0"}, PY)
    sent = {n["host"]: n["bytes_sent"] for n in out["nodes"]}
    assert {n["after"] for n in out["nodes"]} == {want}
    # One copy from the launcher, to the first node; the others got it from the node before.
    beta = (work / "wheels" / "beta-1.0-py3-none-any.whl").stat().st_size
    assert sent["node1"] > beta and sent["node2"] == sent["node3"] == 0, sent
    for node in bed.nodes:
        cached = bed.private_of(node) / "relayed" / "cache" / "wheels" / "beta-1.0-py3-none-any.whl"
        assert cached.stat().st_size == beta
        said = bed.ns_run(node, [f"{root}/current/bin/python", "-c", "import beta; print(1)"])
        assert said.stdout.strip() == "1"
