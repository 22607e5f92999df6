"""herd.toml, hostfiles and host lists: valid input loads, bad input names the place and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchherd.errors import ConfigError
from torchherd.spec import (
    expand_nodelist,
    load_cluster_file,
    parse_cluster_toml,
    parse_host_list,
    parse_hostfile,
    read_env_file,
)

FULL = """
[cluster]
python = "/opt/venv/bin/python"
workdir = "~/project"
ssh_config = "ssh_config"
env = { NCCL_DEBUG = "WARN" }
env_file = ".env"

[[node]]
host = "gpu1"
nproc = 4
addr = "10.0.0.1"
iface = "eth1"

[[node]]
host = "alice@gpu2"
"""


def test_full_example_loads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "herd.toml"
    path.write_text(FULL)
    spec = load_cluster_file(path)
    assert [n.host for n in spec.nodes] == ["gpu1", "alice@gpu2"]
    assert spec.nodes[1].name == "gpu2"
    assert spec.nodes[0].nproc == 4 and spec.nodes[1].nproc is None
    assert spec.ssh_config == str(tmp_path / "ssh_config")
    assert spec.env_file == str(tmp_path / ".env")
    assert spec.env == {"NCCL_DEBUG": "WARN"}
    assert spec.rendezvous_node.host == "gpu1"


def test_the_rendezvous_node_is_the_first_node_that_is_not_a_spare(tmp_path: Path) -> None:
    path = tmp_path / "herd.toml"
    nodes = '[[node]]\nhost = "s1"\nspare = true\n[[node]]\nhost = "a"\n[[node]]\nhost = "b"\n'
    path.write_text(nodes)
    spec = load_cluster_file(path)
    assert spec.rendezvous_node is spec.active[0] and spec.rendezvous_node.host == "a"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[cluster]\npython = "x"\n[[node]]\nhost = "a"\nnprocs = 2\n',
            ["line 5", "nprocs", "did you mean 'nproc'"],
        ),
        (
            '[cluster]\npyhton = "x"\n[[node]]\nhost = "a"\n',
            ["line 2", "pyhton", "did you mean 'python'"],
        ),
        ('[[node]]\nhost = "a"\n[[node]]\nhost = "a"\n', ["duplicate host 'a'"]),
        ('[[node]]\nhost = "a"\nnproc = 0\n', ["line 3", "nproc", "1 or more"]),
        ('[[node]]\nhost = "a"\nnproc = "four"\n', ["line 3", "nproc"]),
        ('[cluster]\npython = "x"\n', ["no nodes"]),
        ('[[node]]\nhost = "a"\naddr = "not-an-ip"\n', ["line 3", "not an IP address"]),
        ('[[node]]\nhost = "a b"\n', ["ssh destination"]),
        ('[[node]\nhost = "a"\n', ["not valid TOML", "line 1"]),
        ('[nodes]\nhost = "a"\n', ["line 1", "unknown section", "did you mean 'node'"]),
        (
            '[cluster]\nenv = { "1BAD" = "x" }\n[[node]]\nhost = "a"\n',
            ["env", "not a valid environment variable"],
        ),
        ('[cluster]\nconnect_timeout = -1\n[[node]]\nhost = "a"\n', ["line 2", "connect_timeout"]),
    ],
)
def test_bad_files_name_the_line_and_the_fix(text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_cluster_toml(text, "herd.toml")
    message = f"{caught.value.message} {caught.value.remedy}"
    for fragment in expected:
        assert fragment in message, message
    assert caught.value.remedy, "every error carries a remedy"
    assert caught.value.exit_code == 2


def test_missing_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as caught:
        load_cluster_file(tmp_path / "nope.toml")
    assert "herd init" in caught.value.remedy


def test_hostfile_with_comments_and_blank_lines() -> None:
    spec = parse_hostfile(
        "# workers\nworker-1 slots=4\n\nworker-2 slots=2 # two GPUs\nworker-3\n", "hostfile"
    )
    assert [(n.host, n.nproc) for n in spec.nodes] == [
        ("worker-1", 4),
        ("worker-2", 2),
        ("worker-3", None),
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a slots=x\n", "line 1"),
        ("a slots=1\nb slots=2\na slots=1\n", "line 3"),
        ("# nothing\n", "no hosts"),
        ("a slots=0\n", "1 or more"),
    ],
)
def test_bad_hostfile_lines_are_named(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_hostfile(text, "hostfile")


def test_hostfile_given_with_c_is_read_as_a_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("gpu1 slots=8\ngpu2 slots=8\n")
    assert [n.nproc for n in load_cluster_file(path).nodes] == [8, 8]


def test_host_list() -> None:
    spec = parse_host_list("h1:4,h2:2,bob@h3")
    assert [(n.host, n.nproc) for n in spec.nodes] == [("h1", 4), ("h2", 2), ("bob@h3", None)]
    with pytest.raises(ConfigError, match="worker count"):
        parse_host_list("h1:four")
    with pytest.raises(ConfigError, match="duplicate"):
        parse_host_list("h1,h1")


def test_slurm_nodelist_expansion() -> None:
    assert expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    with pytest.raises(ConfigError):
        expand_nodelist("n[a-b]")


def test_env_file(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text('# secrets\nexport HF_TOKEN="abc 123"\nWANDB_API_KEY=xyz\n')
    assert read_env_file(path) == {"HF_TOKEN": "abc 123", "WANDB_API_KEY": "xyz"}
    path.write_text("NOT A LINE\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_env_file(path)


def test_herds_models_skip_pydantics_plugin_scan_and_leave_it_to_the_users() -> None:
    """herd's two models are built without the plugin scan (a tenth of each command's start);
    the setting is not left behind, so the user's own models still find their plugins."""
    probe = (
        "import os, pydantic.plugin._loader as loader, torchherd.spec as spec\n"
        "assert spec.ClusterSpec.__pydantic_complete__ and spec.NodeSpec.__pydantic_complete__\n"
        "print(os.environ.get('PYDANTIC_DISABLE_PLUGINS'), loader._plugins)\n"
        "spec.parse_host_list('a,b:2')\n"
        "import pydantic\n"
        "class Mine(pydantic.BaseModel):\n"
        "    x: int = 0\n"
        "print(loader._plugins is not None)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Nothing left set and nothing scanned by herd; then the user's model scanned.
    assert done.stdout.split("\n")[:2] == ["None None", "True"], done.stdout
