"""The `conveyor` command-line tool on real graph files."""
import os
import subprocess

import pytest
import torch

import conveyor
import zoo

BUILD = os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TOOL = os.path.join(BUILD, "tools", "conveyor")

pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason=f"conveyor tool not built at {TOOL}")


def run(*args):
    return subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def resnet_file(tmp_path_factory):
    torch.manual_seed(0)
    case = zoo.resnet18()
    path = tmp_path_factory.mktemp("cli") / "resnet18.cvg"
    conveyor.capture(case.model, case.args).save(path)
    return path


def test_inspect_summarizes(resnet_file):
    r = run("inspect", resnet_file)
    assert r.returncode == 0, r.stderr
    assert "aten::conv2d" in r.stdout
    assert "62 parameters" in r.stdout and "60 buffers" in r.stdout
    assert "= batch" in r.stdout


def test_partition_prints_valid_stages(resnet_file):
    r = run("partition", resnet_file, "--stages", 4, "--seed", 2)
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line[:1].isdigit()]) == 4


def test_bad_files_fail_cleanly(resnet_file, tmp_path):
    broken = tmp_path / "broken.cvg"
    broken.write_bytes(resnet_file.read_bytes()[:1000])
    r = run("validate", broken)
    assert r.returncode == 1
    assert "truncated" in r.stderr
    r = run("partition", resnet_file, "--stages", 0)
    assert r.returncode != 0


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
OP_GRAPHS = sorted(f for f in os.listdir(os.path.join(EXAMPLES, "op_graphs")) if f.endswith(".json"))
CLUSTERS = sorted(f for f in os.listdir(os.path.join(EXAMPLES, "clusters")) if f.endswith(".toml"))


@pytest.mark.parametrize("graph", OP_GRAPHS)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_example_graph_plans_on_every_example_cluster_within_the_budget(graph, cluster):
    """The repository's own examples, as the README's commands give them: each plans (the
    search stops at its 30 s time budget with the best plan so far; `run`'s 60 s timeout
    would otherwise fail the test), and the search's progress is on stderr as it goes."""
    r = run("plan", "--graph", os.path.join(EXAMPLES, "op_graphs", graph),
            "--cluster", os.path.join(EXAMPLES, "clusters", cluster), "--batch", 64)
    assert r.returncode == 0, r.stderr
    assert "predicted step" in r.stdout and "search:" in r.stdout
    progress = [line for line in r.stderr.splitlines() if line.startswith("planning: ")]
    assert progress and " searches done in " in progress[-1]
    done, total = progress[-1].split("planning: ")[1].split(" searches")[0].split(" of ")
    assert done == total, progress[-1]


def test_names_read_from_files_are_printed_printable(tmp_path):
    """A trace whose track and slice names hold terminal escapes: `trace check` prints them as
    '?', never raw (common/printable.h, the one excerpt for every printed name)."""
    trace = conveyor._C.PerfettoTrace()
    track = trace.add_track("\x1b[31mred track")
    trace.slice(track, 0, 10, "\x1b]0;title\x07slice")
    path = tmp_path / "names.pftrace"
    trace.write(str(path))
    r = run("trace", "check", path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "?[31mred track" in r.stdout, r.stdout


def test_arguments_are_quoted_printable(tmp_path):
    """Found by a user trial: CLI11's errors and a path quoted terminal escapes raw; --batch 0
    named a 309-digit bound."""
    escape = "\x1b[2J\x1b]0;T\x07"
    for args in (["launch", "--transport", escape, "--", "true"], ["launch", "--config", tmp_path / escape, "--", "true"]):
        r = run(*args)
        assert r.returncode != 0 and "\x1b" not in r.stderr and "\x07" not in r.stderr, r.stderr
        assert "?[2J" in r.stderr, r.stderr
    r = run("plan", "--graph", "g.json", "--cluster", "c.toml", "--batch", 0)
    assert r.returncode != 0 and "not in range 1 to 2147483647" in r.stderr and len(r.stderr) < 200, r.stderr


def test_a_config_past_its_size_limit_is_refused_before_it_is_parsed(tmp_path):
    """A 32 MiB job config (16 million list items) aborted the launcher with std::bad_alloc
    under a 4 GB address-space limit: TOML files hold at most 16 MiB (docs/formats.md)."""
    config = tmp_path / "big.toml"
    config.write_text("[job]\nhosts = [" + "1," * (16 << 20) + "]\n")
    r = subprocess.run(["bash", "-c", f"ulimit -v 4000000; exec {TOOL} launch --config {config} -- true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "larger than the 16 MiB a job config may hold" in r.stderr, r.stderr
