"""herd init: host lists and hostfiles to a herd.toml that the real loader accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.errors import ConfigError
from torchherd.ops.init import (
    GpuProbe,
    describe_gpus,
    nodes_from,
    render,
    with_probed_nproc,
    write_cluster_file,
)
from torchherd.spec import CLUSTER_KEYS, NodeSpec, load_cluster_file, parse_cluster_toml


def test_render_round_trips_through_the_loader(tmp_path: Path) -> None:
    cluster = nodes_from(["gpu1", "gpu2:4,alice@10.0.0.7:2"], None)
    text = render(
        cluster.nodes,
        python="/opt/venv/bin/python",
        workdir="~/project",
        ssh_config='/etc/odd "name"',
        comments={"gpu1": "8 × NVIDIA H100"},
    )
    spec = parse_cluster_toml(text, "t.toml")
    assert [(n.host, n.nproc) for n in spec.nodes] == [
        ("gpu1", None),
        ("gpu2", 4),
        ("alice@10.0.0.7", 2),
    ]
    assert (spec.python, spec.workdir, spec.ssh_config) == (
        "/opt/venv/bin/python",
        "~/project",
        '/etc/odd "name"',
    )
    assert 'host = "gpu1"  # 8 × NVIDIA H100' in text
    assert '# env_file = ".env"' in text  # the optional keys are shown, commented out


def test_hostfile_and_errors(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu1 slots=8\n# comment\ngpu2 slots=4\n")
    assert [(n.host, n.nproc) for n in nodes_from([], str(hostfile)).nodes] == [
        ("gpu1", 8),
        ("gpu2", 4),
    ]
    with pytest.raises(ConfigError, match="not both"):
        nodes_from(["gpu1"], str(hostfile))
    with pytest.raises(ConfigError, match="no hosts"):
        nodes_from([], None)
    with pytest.raises(ConfigError, match="worker count"):
        nodes_from(["gpu1:x"], None)
    with pytest.raises(ConfigError, match="duplicate"):
        nodes_from(["gpu1", "gpu1:2"], None)


def test_probed_counts_fill_only_missing_nproc() -> None:
    cluster = nodes_from(["a", "b:3", "c", "d"], None)
    probes = [
        GpuProbe("a", 8, ("NVIDIA H100 80GB HBM3",) * 8),
        GpuProbe("b", 2),
        GpuProbe("c", 0),
        GpuProbe("d", None, error="unreachable"),
    ]
    nodes = with_probed_nproc(cluster, probes)
    assert [(n.host, n.nproc) for n in nodes] == [("a", 8), ("b", 3), ("c", 1), ("d", None)]
    assert describe_gpus(probes[0]) == "8 × NVIDIA H100 80GB HBM3"
    assert describe_gpus(GpuProbe("x", 2, ("/dev/nvidia0", "/dev/nvidia1"))) == "2 GPU(s)"
    assert describe_gpus(probes[2]) == "no GPU found"


def test_write_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    path = tmp_path / "herd.toml"
    text = render(nodes_from(["gpu1"], None).nodes)
    write_cluster_file(path, text)
    with pytest.raises(ConfigError, match="already exists") as caught:
        write_cluster_file(path, render(nodes_from(["gpu9"], None).nodes))
    assert "--force" in caught.value.remedy
    assert load_cluster_file(path).nodes[0].host == "gpu1"
    write_cluster_file(path, render(nodes_from(["gpu9"], None).nodes), force=True)
    assert load_cluster_file(path).nodes[0].host == "gpu9"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["herd.toml"]  # no temporary left


def test_cli_init_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init", "gpu1", "gpu2:4"]) == 0
    assert "wrote herd.toml: 2 node(s) [gpu1, gpu2×4]" in capsys.readouterr().out
    assert main(["init", "gpu3"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["init", "-o", "other.toml"]) == 2
    assert "no hosts given" in capsys.readouterr().err
    assert main(["init", "gpu1:0", "-o", "other.toml"]) == 2
    assert "worker count must be 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "other.toml").exists()


def test_the_written_file_points_only_at_what_exists_and_names_every_key() -> None:
    text = render([NodeSpec(host="gpu1", nproc=8)])
    assert "docs/" not in text  # it pointed at docs/operations.md, which does not exist
    assert 'README, section "herd.toml"' in text
    for key in CLUSTER_KEYS:
        assert f"# {key} = " in text, key
    assert parse_cluster_toml(text, "t.toml").nodes[0].nproc == 8
