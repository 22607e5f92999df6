"""Slurm/PBS pieces that need no scheduler: hostlists, nodefiles, job ids, detection, the
environment that travels, srun's command lines (one step across the nodes for agent verbs, a
step per node for the rest), how a step's words finish a node's command, and the setup
prelude."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from torchherd.agent.relay import CANNOT_CONNECT
from torchherd.errors import ConfigError, HerdError
from torchherd.hostlist import compress_hostlist, expand_hostlist, parse_nodefile
from torchherd.scheduler.detect import (
    Allocation,
    cluster_for_allocation,
    detect_allocation,
    parse_node_addresses,
)
from torchherd.scheduler.environment import carried_environment
from torchherd.scheduler.jobid import (
    parse_pbs_jobid,
    parse_qsub_output,
    parse_sbatch_output,
    parse_slurm_jobid,
)
from torchherd.spec import ClusterSpec, NodeSpec, expand_nodelist, parse_cluster_toml
from torchherd.transport.base import SETUP_FAILED_EXIT, remote_line, setup_failure
from torchherd.transport.relay import LINK_LOST, LINK_LOST_MARK, RelayedProcess, StepBatch
from torchherd.transport.slurm import (
    classify_srun_failure,
    cpus_per_node,
    relayed,
    srun_argv,
    step_argv,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu1", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("rack[1-2]n[1,3].ib", ["rack1n1.ib", "rack1n3.ib", "rack2n1.ib", "rack2n3.ib"]),
        ("x[1],y,z[2-3]", ["x1", "y", "z2", "z3"]),
        ("node1 node2", ["node1", "node2"]),  # white space separates, as in Slurm
        ("node[1-2] node3\n", ["node1", "node2", "node3"]),
    ],
)
def test_hostlist_expands_like_slurm(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert expand_nodelist(text) == hosts  # the spec's loader uses the same expander


@pytest.mark.parametrize(
    ("hosts", "text"),
    [
        (["node1"], "node1"),
        (["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"], "gpu[01-03,07],cpu1"),
        (["n8", "n9", "n10", "n11"], "n[8-11]"),
        (["n098", "n099", "n100", "n101"], "n[098-101]"),
        ([f"sim{i}" for i in reversed(range(1000))], "sim[0-999]"),
        (["b2", "a", "b1", "b1", "c.ib"], "b[1-2],a,c.ib"),
        (["x01", "x1", "x2"], "x01,x[1-2]"),  # x1 is not x01: each keeps its own width
    ],
)
def test_hosts_compress_into_a_hostlist_that_expands_back(hosts: list[str], text: str) -> None:
    assert compress_hostlist(hosts) == text
    assert sorted(expand_hostlist(text)) == sorted(set(hosts))


@pytest.mark.parametrize("text", ["gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[5-2]", "g[1[2]]"])
def test_hostlist_errors_name_the_list(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_hostlist(text)
    assert repr(text) in info.value.message
    assert "gpu[01-04,07]" in info.value.remedy


def test_nodefile_dedupes_in_first_seen_order_keeping_fqdns() -> None:
    text = "n2.cluster.org\nn2.cluster.org\nn1.cluster.org\nn1.cluster.org\n\nn3\n"
    assert parse_nodefile(text) == ["n2.cluster.org", "n1.cluster.org", "n3"]


def test_job_ids() -> None:
    assert parse_sbatch_output("Submitted batch job 4211\n").number == 4211
    assert parse_sbatch_output("4212;cluster\n").text == "4212"
    slurm = parse_slurm_jobid("77_3")
    assert (slurm.number, slurm.index) == (77, 3)
    pbs = parse_pbs_jobid("123.pbs01")
    assert (pbs.number, pbs.index, pbs.server, pbs.array) == (123, None, "pbs01", False)
    sub = parse_pbs_jobid("123[4].pbs01.example.org")
    assert (sub.number, sub.index, sub.server) == (123, 4, "pbs01.example.org")
    assert parse_pbs_jobid("9[].s").array
    assert parse_qsub_output("\n456.server\n").text == "456.server"
    for bad in ("abc", "12x"):
        with pytest.raises(HerdError):
            parse_slurm_jobid(bad)
        with pytest.raises(HerdError):
            parse_pbs_jobid(bad)
    with pytest.raises(HerdError):
        parse_sbatch_output("sbatch: error: invalid partition")


def _nodefile(tmp_path: Path) -> str:
    path = tmp_path / "nodefile"
    path.write_text("b.x.org\nb.x.org\na.x.org\na.x.org\n")
    return str(path)


def test_detection_order(tmp_path: Path) -> None:
    nodefile = _nodefile(tmp_path)
    both = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "PBS_JOBID": "7.srv",
        "PBS_NODEFILE": nodefile,
        "PATH": "",
    }
    found = detect_allocation(both)
    assert found is not None and found.scheduler == "slurm"  # Slurm first, always
    assert found.hosts == ("n1", "n2")
    assert found.variables == ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")
    pbs = detect_allocation({"PBS_JOBID": "7.srv", "PBS_NODEFILE": nodefile})
    assert pbs is not None and pbs.scheduler == "pbs" and pbs.hosts == ("b.x.org", "a.x.org")
    assert "PBS job 7.srv" in pbs.describe() and "PBS_NODEFILE" in pbs.describe()
    # PBS_JOBID without a readable nodefile (Slurm's torque wrappers set it): not PBS.
    assert detect_allocation({"PBS_JOBID": "7.srv", "PBS_NODEFILE": str(tmp_path / "no")}) is None
    assert detect_allocation({}) is None
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        detect_allocation({"SLURM_JOB_ID": "5"})
    # `srun -N2 herd launch`: two launchers would each start the job on every node.
    step = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_ID": "0", "PATH": ""}
    with pytest.raises(ConfigError, match="job step of 2 tasks"):
        detect_allocation({**step, "SLURM_STEP_NUM_TASKS": "2"})
    single = detect_allocation({**step, "SLURM_STEP_NUM_TASKS": "1"})  # srun --pty bash
    assert single is not None and single.hosts == ("n1",)


def test_gpus_per_node_from_the_scheduler(tmp_path: Path) -> None:
    slurm = detect_allocation(
        {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "4", "PATH": ""}
    )
    assert slurm is not None and slurm.gpus_per_node == 4
    pbs = detect_allocation(
        {"PBS_JOBID": "7", "PBS_NODEFILE": _nodefile(tmp_path), "CUDA_VISIBLE_DEVICES": "0,1"}
    )
    assert pbs is not None and pbs.gpus_per_node == 2


def test_cluster_of_an_allocation_keeps_file_settings() -> None:
    settings = parse_cluster_toml(
        '[cluster]\nsetup = "module load cuda"\nenv = { A = "1" }\n\n'
        '[[node]]\nhost = "n2"\nnproc = 3\nsetup = "echo n2"\n',
        "herd.toml",
    )
    allocation = Allocation("slurm", "5", ("n1", "n2"), ("SLURM_JOB_ID",), 2, {"n1": "10.0.0.1"})
    environ = {"PATH": "/venv/bin:/usr/bin", "NCCL_DEBUG": "INFO", "HF_TOKEN": "x"}
    cluster = cluster_for_allocation(allocation, settings, environ)
    assert cluster.transport == "slurm" and cluster.scheduler_job_id == "5"
    assert [n.host for n in cluster.nodes] == ["n1", "n2"]
    assert [n.nproc for n in cluster.nodes] == [2, 3]
    assert cluster.nodes[0].addr == "10.0.0.1"
    assert cluster.python == sys.executable  # the launcher's interpreter, none configured
    assert cluster.env == {"A": "1"}
    assert cluster.carry_env == {"PATH": "/venv/bin:/usr/bin", "NCCL_DEBUG": "INFO"}
    assert cluster.setup_for(cluster.nodes[0]) == "module load cuda"
    assert cluster.setup_for(cluster.nodes[1]) == "{ module load cuda\n} && { echo n2\n}"
    assert "Slurm job 5" in cluster.source
    configured = parse_cluster_toml('[cluster]\npython = "/opt/py"\n\n[[node]]\nhost = "x"\n', "f")
    assert cluster_for_allocation(allocation, configured, {}).python == "/opt/py"


def test_carried_environment_is_an_allow_list() -> None:
    environ = {
        "PATH": "/p",
        "LD_LIBRARY_PATH": "/l",
        "VIRTUAL_ENV": "/v",
        "NCCL_IB_HCA": "mlx5",
        "CUDA_HOME": "/cuda",
        "CUDA_VISIBLE_DEVICES": "0",  # each node has its own
        "NCCL_SECRET_KEY": "s",  # looks like a secret: env_file's job
        "HOME": "/root",
        "SSH_CONNECTION": "1 2 3 4",
        "SLURM_JOB_ID": "5",
    }
    assert carried_environment(environ) == {
        "PATH": "/p",
        "LD_LIBRARY_PATH": "/l",
        "VIRTUAL_ENV": "/v",
        "NCCL_IB_HCA": "mlx5",
        "CUDA_HOME": "/cuda",
    }


def test_scontrol_node_addresses() -> None:
    text = (
        "NodeName=node1 Arch=x86_64 NodeAddr=10.1.1.11 NodeHostName=node1\n"
        "NodeName=node2 NodeAddr=node2 State=IDLE\n"
    )
    assert parse_node_addresses(text) == {"node1": "10.1.1.11", "node2": "node2"}


def test_srun_one_task_per_node_with_explicit_cpus() -> None:
    hosts = ("a1", "a2", "a3")
    assert cpus_per_node(hosts, {"SLURM_JOB_CPUS_PER_NODE": "8,4(x2)"}) == {
        "a1": 8,
        "a2": 4,
        "a3": 4,
    }
    assert cpus_per_node(hosts, {"SLURM_CPUS_ON_NODE": "6"})["a3"] == 6
    argv = srun_argv("srun", "55", "a2", 4)
    for option in (
        "--jobid=55",
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--nodelist=a2",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=4",
        "--overlap",
    ):
        assert option in argv


def test_srun_failures_are_told_from_task_failures() -> None:
    step = "srun: error: Unable to create step for job 5: Invalid node name specified\n"
    found = classify_srun_failure("a2", 1, step)
    assert found is not None and found.reason == "srun-error" and "a2" in found.remedy
    task = "srun: error: a2: task 0: Exited with exit code 1\n"
    assert classify_srun_failure("a2", 1, task) is None


def test_agent_verbs_are_one_step_across_the_nodes() -> None:
    assert relayed(["/venv/bin/python", "-m", "torchherd.agent", "run"])
    assert relayed(("python3", "-m", "torchherd.agent", "probe"))
    assert not relayed(["sh", "-c", "wrapper", "herd-exec"])
    assert not relayed("python3 -m torchherd.agent run")  # a shell line: not one of ours
    argv = step_argv("srun", "55", ["a1", "a2", "a3"], 4)
    for option in (
        "--jobid=55",
        "--nodes=3",
        "--ntasks=3",
        "--ntasks-per-node=1",
        "--nodelist=a1,a2,a3",
        # One node's command ending (even badly) must not end the other nodes' commands.
        "--kill-on-bad-exit=0",
        "--wait=0",
        # A node Slurm marks down must not end the other agents (spares too): herd decides.
        "--no-kill",
        "--cpus-per-task=4",
        "--overlap",
        "--label",
        "--input=all",
    ):
        assert option in argv


def test_a_task_that_never_connected_is_finished_from_the_steps_words() -> None:
    # What srun prints (--label) when a node's python has no torchherd: the task's own line,
    # labelled with its task id, then srun's line for the task's end.
    words = (
        "echo '1: /venv/bin/python: Error while finding module specification for "
        "torchherd.agent.relay (ModuleNotFoundError: No module named torchherd)' >&2; "
        "echo 'srun: error: a2: task 1: Exited with exit code 1' >&2; exit 1"
    )

    async def main() -> tuple[RelayedProcess, RelayedProcess]:
        loop = asyncio.get_running_loop()
        batch = StepBatch("1")
        waiting, connected = RelayedProcess("a2", loop), RelayedProcess("a1", loop)
        batch.add("a2", "a2", waiting)
        batch.add("a1", "a1", connected)
        connected.finish(0)  # its relay connected and its command ended well
        batch.srun = await asyncio.create_subprocess_exec(
            "sh", "-c", words, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )

        class Server:
            def forget(self, batch: str, node: str) -> None:
                pass

        await batch.watch(Server())  # type: ignore[arg-type]
        return waiting, connected

    waiting, connected = asyncio.run(main())
    assert waiting.returncode == 1 and connected.returncode == 0
    stderr = asyncio.run(_read_all(waiting))
    assert "No module named torchherd" in stderr


async def _read_all(process: RelayedProcess) -> str:
    assert process.stderr is not None
    return (await process.stderr.read()).decode()


def test_relay_failures_are_unreachable_nodes() -> None:
    dialled = f"{CANNOT_CONNECT}: 10.0.0.1:40000 (SLURM_LAUNCH_NODE_IPADDR): timed out\n"
    found = classify_srun_failure("a2", 1, dialled)
    assert found is not None and found.reason == "relay" and "TCP" in found.remedy
    lost = classify_srun_failure("a2", LINK_LOST, f"{LINK_LOST_MARK} a2\n")
    assert lost is not None and lost.reason == "link-lost"
    assert classify_srun_failure("a2", 3, "Traceback ...\n") is None  # the command's own exit


def test_setup_prelude_runs_in_the_shell_of_the_command(tmp_path: Path) -> None:
    activate = tmp_path / "activate"
    activate.write_text("export FROM_SETUP=yes\necho loading\n")
    line = remote_line(
        ["sh", "-c", "echo $FROM_SETUP $X"], str(tmp_path), {"X": "1"}, setup=f". {activate}"
    )
    done = subprocess.run(["sh", "-c", line], capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout == "yes 1\n"  # the prelude's own output goes to stderr, not the channel
    assert "loading" in done.stderr
    failing = remote_line(["true"], None, None, setup="echo cuda/12.6 not found >&2; false")
    done = subprocess.run(["sh", "-c", failing], capture_output=True, text=True)
    assert done.returncode == SETUP_FAILED_EXIT
    shown = setup_failure(done.returncode, done.stderr)
    assert shown is not None and "cuda/12.6 not found" in shown
    assert setup_failure(1, done.stderr) is None


def test_cluster_file_accepts_setup() -> None:
    cluster = parse_cluster_toml(
        '[cluster]\nsetup = "source ~/venv/bin/activate"\n\n[[node]]\nhost = "a"\n', "f"
    )
    assert cluster.setup_for(cluster.nodes[0]) == "source ~/venv/bin/activate"
    assert ClusterSpec(nodes=(NodeSpec(host="a"),)).setup_for(NodeSpec(host="a")) is None
    with pytest.raises(ConfigError, match="carry_env"):
        parse_cluster_toml('[cluster]\ncarry_env = {}\n\n[[node]]\nhost = "a"\n', "f")


def test_pbs_without_its_client_tools_runs_on_and_says_what_it_cannot_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PBS compute node whose PATH has no qstat/qsub (the job script did not load the PBS
    module): the real commands are looked up and not found; herd says so, never a traceback."""
    from torchherd.scheduler.requeue import pbs_deadline, requeue_after_save

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scheduler command at all
    cluster = parse_cluster_toml('[[node]]\nhost = "n1"\n', "herd.toml").model_copy(
        update={"transport": "pbs", "scheduler_job_id": "12.server"}
    )
    said: list[str] = []
    assert pbs_deadline(cluster, 120, say=said.append) is None
    assert (
        said and "the walltime of PBS job 12.server is unknown (qstat is not on PATH)" in (said[0])
    )
    script = tmp_path / "job.pbs"
    script.write_text("#!/bin/bash\n")
    line = requeue_after_save(cluster, 3, {"HERD_JOB_SCRIPT": str(script)})
    assert line == f"herd: cannot resubmit {script}: qsub is not on PATH"
    slurm = cluster.model_copy(update={"transport": "slurm", "scheduler_job_id": "77"})
    assert requeue_after_save(slurm, 3, {}) == (
        "herd: cannot requeue job 77: scontrol is not on PATH"
    )
