"""How the readers' time grows with their input: a graph node of n arguments (`conveyor
inspect`), a plan of n devices (`conveyor simulate`), a TOML file of n keys and of n table
headers (`conveyor plan --cluster`, refused after reading, by its unknown keys), and a profile
of n nodes (`conveyor plan --profile`, refused after reading, for another graph), for n =
10^4, 10^5 and 10^6. Each should take about ten times as long per tenfold input (linear);
the last column is that ratio. The inputs are written to a temporary folder.

    python bench/reader_scaling.py [--sizes 10000,100000,1000000]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import conveyor

TOOL = os.path.join(os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "build")),
                    "tools", "conveyor")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def timed(args) -> float:
    start = time.perf_counter()
    r = subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - start
    if r.returncode < 0:
        raise SystemExit(f"{' '.join(map(str, args))} crashed (signal {-r.returncode}): {r.stderr[-500:]}")
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    sizes = [int(n) for n in ap.parse_args().sizes.split(",")]
    folder = tempfile.mkdtemp(prefix="reader-scaling-")
    graph = conveyor.capture(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    doc = graph.document
    graph_file = os.path.join(folder, "small.cvg")
    graph.save(graph_file)
    op_graph = os.path.join(ROOT, "examples/op_graphs/layer-gnmt.json")  # needs no profile: the cluster is read next
    plan_file = os.path.join(folder, "plan.json")
    subprocess.run([TOOL, "plan", "--graph", os.path.join(ROOT, "examples/op_graphs/layer-gnmt.json"), "--cluster",
                    os.path.join(ROOT, "examples/clusters/dgx-h100-16.toml"), "--batch", "64", "--out", plan_file],
                   check=True, capture_output=True)
    plan = json.load(open(plan_file))
    cluster_head = open(os.path.join(ROOT, "examples/clusters/dgx-h100-16.toml")).read()
    profile_node = {"forward_s": 1e-6, "backward_s": 0.0, "backward_weight_s": 0.0, "saved_bytes": 0.0,
                    "work_bytes": 0.0, "selective_forward_s": 0.0, "selective_freed_bytes": 0.0,
                    "selective_work_bytes": 0.0}

    def arguments(n):
        d = json.loads(json.dumps(doc))
        node = next(x for x in d["nodes"] if x["op"] == "aten::linear")
        node["args"] = [node["args"][0]] * n
        path = os.path.join(folder, f"args{n}.cvg")
        conveyor._C.save_graph_file(path, conveyor._C.GraphIR(json.dumps(d)), list(graph.tensors.items()))
        return ["inspect", path]

    def devices(n):
        path = os.path.join(folder, f"devices{n}.json")
        json.dump(dict(plan, devices=[plan["devices"][0]] * n), open(path, "w"))
        return ["simulate", "--plan", path]

    def keys(n):
        path = os.path.join(folder, f"keys{n}.toml")
        open(path, "w").write("".join(f"k{k}=1\n" for k in range(n)) + cluster_head)  # 10^6: within 16 MiB
        return ["plan", "--graph", op_graph, "--cluster", path, "--batch", 8]

    def headers(n):
        path = os.path.join(folder, f"headers{n}.toml")
        open(path, "w").write(cluster_head + "".join(f"[t{k}]\nx=1\n" for k in range(n)))
        return ["plan", "--graph", op_graph, "--cluster", path, "--batch", 8]

    def profile_nodes(n):
        path = os.path.join(folder, f"profile{n}.json")
        json.dump({"format": "conveyor.profile", "version": 1, "graph_hash": "0", "device": "cpu", "microbatch": 2,
                   "torch": torch.__version__, "nodes": [profile_node] * n, "value_bytes": [0.0] * n,
                   "value_saved_by": [[]] * n, "units": n, "units_measured": n, "peak_rss_bytes": 0}, open(path, "w"))
        return ["plan", "--graph", graph_file, "--profile", path, "--cluster",
                os.path.join(ROOT, "examples/clusters/dgx-h100-16.toml"), "--batch", 8]

    print(f"{'input':<28}" + "".join(f"{n:>12,}" for n in sizes) + "   time x per 10x")
    for name, make in [("node arguments (inspect)", arguments), ("plan devices (simulate)", devices),
                       ("TOML keys (plan --cluster)", keys), ("TOML headers (plan --cluster)", headers),
                       ("profile nodes (plan --profile)", profile_nodes)]:
        times = [timed(make(n)) for n in sizes]
        growth = ", ".join(f"{b / a:.1f}" for a, b in zip(times, times[1:]))
        print(f"{name:<28}" + "".join(f"{t:>11.2f}s" for t in times) + f"   {growth}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
