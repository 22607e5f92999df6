"""What `herd launch --env-sync` decides before any node is asked: where environments live,
which python the job runs, which nodes differ, and a lock herd's agent cannot run in."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.envs.at_launch import LaunchEnvironment, root_for
from torchherd.errors import ConfigError
from torchherd.spec import ClusterSpec, NodeSpec, load_cluster_file


def cluster(**extra: object) -> ClusterSpec:
    nodes = (NodeSpec(host="gpu1", python="/opt/other/python"), NodeSpec(host="gpu2"))
    return ClusterSpec(nodes=nodes, source="test", **extra)  # type: ignore[arg-type]


def test_environments_go_to_node_local_scratch_inside_an_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert root_for(cluster()) == "~/.herd/envs"
    assert root_for(cluster(env_root="/local/envs")) == "/local/envs"
    monkeypatch.setenv("TMPDIR", "/scratch/job42")
    assert root_for(cluster(transport="slurm")) == "/scratch/job42/herd-envs"
    monkeypatch.delenv("TMPDIR")
    assert root_for(cluster(transport="pbs")) == "/tmp/herd-envs"
    assert root_for(cluster(transport="pbs", env_root="/local/envs")) == "/local/envs"


def test_the_job_runs_the_environment_named_by_its_hash_and_differing_nodes_are_found(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "req.txt"
    lock.write_text("torchherd==0.1.0\nalpha==1.0\n")
    spec = cluster(env_sync=True, env_lock=str(lock), env_root="/local/envs")
    env = LaunchEnvironment.of(spec)
    want = env.target.hash
    running = env.cluster(spec)
    assert {running.python_for(n) for n in running.nodes} == {f"/local/envs/{want}/bin/python"}
    # A node whose probe did not answer (no such python yet) or answered another hash differs.
    assert env.differing(["gpu1", "gpu2"], {"gpu1": want}) == ["gpu2"]
    assert env.differing(["gpu1", "gpu2"], {"gpu1": "0" * 12, "gpu2": want}) == ["gpu1"]
    assert env.differing(["gpu1", "gpu2"], {"gpu1": want, "gpu2": want}) == []


def test_a_lock_without_torchherd_is_refused_with_the_pin_to_add(tmp_path: Path) -> None:
    lock = tmp_path / "req.txt"
    lock.write_text("alpha==1.0\n")
    with pytest.raises(ConfigError) as caught:
        LaunchEnvironment.of(cluster(env_sync=True, env_lock=str(lock)))
    assert "has no torchherd" in caught.value.message
    assert f"add torchherd==0.1.0 to {lock}" in caught.value.remedy


def test_lock_and_wheel_folders_are_relative_to_the_cluster_file(tmp_path: Path) -> None:
    (tmp_path / "herd.toml").write_text(
        '[cluster]\nenv_sync = true\nenv_lock = "req.txt"\nenv_wheels = ["wheels", "/w"]\n'
        '\n[[node]]\nhost = "gpu1"\n'
    )
    spec = load_cluster_file(tmp_path / "herd.toml")
    assert spec.env_sync and spec.env_lock == str(tmp_path / "req.txt")
    assert spec.env_wheels == [str(tmp_path / "wheels"), "/w"]
