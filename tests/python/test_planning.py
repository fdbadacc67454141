"""Profiling captured models and planning them: branchy graphs get valid convex stages
(checked by the graph module's own partition validator), the planned stages run to the
same results as eager, the memory error states a figure that works, the CLI plans, simulates
and writes traces that decode."""
import copy
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import conveyor
import zoo

BUILD = os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TOOL = os.path.join(BUILD, "tools", "conveyor")


def cluster_toml(memory_bytes: float, devices: int = 4, nodes: int = 1) -> str:
    return f"""name = "test"
[[node]]
count = {nodes}
devices = {devices}
memory = {memory_bytes:.0f}
[link.intra_node]
bandwidth = "10 GB/s"
latency = "10 us"
[link.inter_node]
bandwidth = "1 GB/s"
latency = "50 us"
"""


def smallest_memory(graph, prof, batch):
    with pytest.raises(conveyor.DoesNotFitError) as e:
        conveyor.plan(graph, prof, cluster_toml(1024), batch=batch)
    msg = str(e.value)
    m = re.search(r"needs at least ([\d.]+) (B|KiB|MiB|GiB) per device", msg)
    assert m, msg
    scale = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[m.group(2)]
    return float(m.group(1)) * scale


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", ["resnet18", "unet3d", "bert"])
def test_branchy_models_plan_into_valid_stages_that_run_exactly(name):
    torch.manual_seed(0)
    case = getattr(zoo, name)()
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs)
    assert len(prof["nodes"]) == graph.num_nodes
    assert all(n["forward_s"] >= 0 for n in prof["nodes"])
    assert sum(n["forward_s"] for n in prof["nodes"]) > 0
    # With just the memory the planner says is needed, it must cut the model into stages.
    need = smallest_memory(graph, prof, batch=16)
    plan = conveyor.plan(graph, prof, cluster_toml(need * 1.02), batch=16)
    stages = plan.stage_nodes
    assert len(stages) >= 2, str(plan)
    graph.ir.check_partition(stages)  # independent validator: convex, groups whole, ordered
    # The planned stages compute what the model computes.
    staged = graph.split(stages)
    torch.manual_seed(1)
    ref = case.loss(case.model(*case.args, **case.kwargs))
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = case.loss(staged(*case.args, **case.kwargs))
    out.backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for n, p in case.model.named_parameters():
        if n in ref_grads:
            assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5), n


def test_a_saved_plan_reads_back_as_the_same_plan_and_runs_against_its_own_prediction(tmp_path):
    """Plan.save writes the plan document (docs/formats.md), which reads back as the same
    plan; a Module given the file compares its steps with that plan's simulated step."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    again = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.01), loss_fn=case.loss,
                            stages=2, microbatches=2, replan="off")
    model.train_step(*case.args)
    plan = model.plan
    path = tmp_path / "plan.json"
    plan.save(path)
    written = json.loads(path.read_text())
    assert written == plan.document and written["format"] == "conveyor.plan" and written["version"] == 1
    read = conveyor.planning.read_plan(path)
    assert read.document == plan.document and str(read) == str(plan)
    assert (read.stage_nodes, read.replicas, read.schedule, read.microbatches, read.predicted_step_s) == \
        (plan.stage_nodes, plan.replicas, plan.schedule, plan.microbatches, plan.predicted_step_s)
    given = conveyor.Module(again, torch.optim.SGD(again.parameters(), lr=0.01), loss_fn=case.loss, plan=path,
                            replan="off")
    for _ in range(3):
        given.train_step(*case.args)
    assert given.plan.stage_nodes == plan.stage_nodes
    assert given.profile_report().predicted_step_s == pytest.approx(plan.predicted_step_s, rel=1e-12)


def test_profile_is_cached_and_leaves_gradients_alone():
    torch.manual_seed(0)
    case = zoo.mlp()
    graph = conveyor.capture(case.model, case.args)
    for p in case.model.parameters():
        p.grad = torch.full_like(p, 3.0)
    first = conveyor.profile(graph, case.args)
    for p in case.model.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 3.0))
    assert 0 <= first["fixed_fraction"] <= 1  # timed again on a quarter of the microbatch
    cached = list((conveyor.planning.profile_cache_dir()).glob("*.json"))
    assert len(cached) == 1 and first["graph_hash"] in cached[0].name
    assert conveyor.profile(graph, case.args) == first  # read back, not measured again


@pytest.mark.skipif(not os.path.exists(TOOL), reason=f"conveyor tool not built at {TOOL}")
def test_cli_plans_simulates_and_traces(tmp_path):
    torch.manual_seed(0)
    case = zoo.gpt2()
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    gfile = tmp_path / "gpt2.cvg"
    graph.save(gfile)
    prof = conveyor.profile(graph, case.args, case.kwargs)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(cluster_toml(64 * 1024**3, devices=2, nodes=2))
    env = dict(os.environ)
    run = lambda *a: subprocess.run([TOOL, *map(str, a)], capture_output=True, text=True, timeout=120, env=env)
    # The profile is found in the cache by the graph's hash.
    r = run("plan", "--graph", gfile, "--cluster", cluster, "--batch", 16, "--out", tmp_path / "plan.json",
            "--trace", tmp_path / "plan.pftrace")
    assert r.returncode == 0, r.stderr
    assert "predicted step" in r.stdout and "stage" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["format"] == "conveyor.plan" and plan["batch"] == 16
    graph.ir.check_partition([s["ops"] for s in plan["stages"]])
    r = run("simulate", "--plan", tmp_path / "plan.json", "--trace", tmp_path / "sim.pftrace")
    assert r.returncode == 0, r.stderr
    step = float(re.search(r"step time\s+([\d.]+)", r.stdout).group(1))
    assert step > 0
    r = run("trace", "check", tmp_path / "sim.pftrace")
    assert r.returncode == 0, r.stderr
    assert "valid Perfetto trace" in r.stdout
    if shutil.which("protoc"):  # an independent decoder agrees it is a protobuf message
        with open(tmp_path / "sim.pftrace", "rb") as f:
            d = subprocess.run(["protoc", "--decode_raw"], stdin=f, capture_output=True, timeout=60)
        assert d.returncode == 0, d.stderr
        assert b"60 {" in d.stdout and b"11 {" in d.stdout  # track descriptors and track events
    # Errors: a malformed cluster file names its line; a broken trace is refused.
    bad = tmp_path / "bad.toml"
    bad.write_text(cluster.read_text().replace("devices = 2", "devices = \"two\""))
    r = run("plan", "--graph", gfile, "--cluster", bad, "--batch", 16)
    assert r.returncode != 0 and "bad.toml:4: devices in [[node]] must be a positive integer" in r.stderr, r.stderr
    broken = tmp_path / "broken.pftrace"
    broken.write_bytes((tmp_path / "sim.pftrace").read_bytes()[:-5])
    r = run("trace", "check", broken)
    assert r.returncode != 0 and "trace" in r.stderr


@pytest.mark.skipif(not os.path.exists(TOOL), reason=f"conveyor tool not built at {TOOL}")
def test_cli_without_a_profile_says_how_to_make_one(tmp_path):
    torch.manual_seed(0)
    case = zoo.mlp()
    gfile = tmp_path / "mlp.cvg"
    conveyor.capture(case.model, case.args).save(gfile)
    cluster = tmp_path / "c.toml"
    cluster.write_text(cluster_toml(1e9))
    r = subprocess.run([TOOL, "plan", "--graph", str(gfile), "--cluster", str(cluster), "--batch", "8"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert "no profile" in r.stderr and "conveyor.profile" in r.stderr


@pytest.mark.skipif(not os.path.exists(TOOL), reason=f"conveyor tool not built at {TOOL}")
def test_cli_plans_a_plain_op_graph(tmp_path):
    ops = [{"name": f"layer{i}", "forward_s": 1e-3, "backward_s": 2e-3, "output_bytes": 1e5,
            "saved_bytes": 1e5, "params": [i], **({"inputs": [i - 1]} if i else {})} for i in range(12)]
    doc = {"format": "conveyor.op-graph", "version": 1, "name": "chain", "microbatch": 1,
           "params": [{"name": f"w{i}", "bytes": 1e9} for i in range(12)], "ops": ops}
    (tmp_path / "chain.json").write_text(json.dumps(doc))
    (tmp_path / "c.toml").write_text(cluster_toml(16 * 1024**3, devices=4, nodes=2))
    r = subprocess.run([TOOL, "plan", "--graph", str(tmp_path / "chain.json"), "--cluster", str(tmp_path / "c.toml"),
                        "--batch", "32", "--out", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert len(plan["stages"]) >= 3  # 48 GB of weights and state cannot share a 16 GiB device
    assert all(s["memory_bytes"] <= 16 * 1024**3 for s in plan["stages"])
    doc["ops"][3]["inputs"] = [7]  # not a topological order
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    r = subprocess.run([TOOL, "plan", "--graph", str(tmp_path / "bad.json"), "--cluster", str(tmp_path / "c.toml"),
                        "--batch", "32"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "/ops/3/inputs/0" in r.stderr and "topological order" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["gpt2", "resnet18"])
def test_a_fixed_stage_count_gets_the_best_cut_by_the_profile(name):
    """Two stages fixed (what `Module(stages=2)` asks): the planner's cut simulates within 5% of
    the best two-stage cut in capture order, found by pricing every cut point on the same
    profile and cluster (brute force), and it is the one of those the simulator ranks first
    (the search returns the simulator's best, which can rank below the analytic model's)."""
    torch.manual_seed(0)
    case = getattr(zoo, name)()
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs)
    cluster = cluster_toml(64 << 30, devices=2)
    batch = next(t for t in [*case.args, *case.kwargs.values()] if isinstance(t, torch.Tensor)).shape[0]
    plan = conveyor.plan(graph, prof, cluster, batch=batch, microbatches=4, schedules=["1f1b"], even_shares=True,
                         ranks=2, replicas=[1])
    assert len(plan.stage_nodes) == 2 and plan.replicas == [1, 1], str(plan)
    order = sorted(n for stage in plan.stage_nodes for n in stage)
    simulated = []
    for k in range(1, len(order)):
        try:
            priced = conveyor._C.plan_stages(graph.ir, json.dumps(prof), cluster, [order[:k], order[k:]], [1, 1],
                                             batch, 4, "1f1b")
        except conveyor.ConveyorError:
            continue  # not a valid cut (a later node read by an earlier one, or a group split)
        simulated.append(priced.predicted_step_s)
    assert len(simulated) >= 10, "too few valid cut points to compare"
    best = min(simulated)
    print(f"{name}: planned cut {plan.document['predicted_step_s'] * 1e3:.3f} ms, best of {len(simulated)} cut "
          f"points {best * 1e3:.3f} ms ({plan.document['predicted_step_s'] / best:.3f}x)")
    assert plan.document["predicted_step_s"] <= 1.05 * best
    # The search returns the simulator's best of its space, which holds every cut point here.
    assert plan.document["predicted_step_s"] <= best * (1 + 1e-9)
