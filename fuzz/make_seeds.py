"""Writes the fuzz seed corpus (fuzz/corpus/READER/): valid files of every format, made by
conveyor itself from small real models, so the fuzzers start from inputs that reach deep
into each reader. Run it again when a format changes:

    ./run python fuzz/make_seeds.py
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import conveyor
from conveyor.planning import plan, profile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "python"))  # the test models
import zoo  # noqa: E402

TOOL = Path(os.environ.get("CONVEYOR_BUILD_DIR", ROOT.parent / "build")) / "tools" / "conveyor"

# An op graph with a parameter, an operator of two outputs and one reading both (as in
# docs/formats.md); captured models reach the planner as graph files with profiles instead.
OP_GRAPH = """{"format": "conveyor.op-graph", "version": 1, "name": "tiny", "microbatch": 2, "min_share": 1,
 "params": [{"name": "w", "bytes": 4096}],
 "ops": [
  {"name": "embed", "forward_s": 0.001, "backward_s": 0.002, "output_bytes": 1024, "params": [0], "group": 0},
  {"name": "split", "forward_s": 0.001, "backward_s": 0.001, "output_bytes": [512, 256], "inputs": [0], "group": 0},
  {"name": "join", "forward_s": 0.002, "backward_s": 0.003, "backward_weight_s": 0.001,
   "inputs": [[1, 0], [1, 1], 0], "saved_bytes": 100, "work_bytes": 50}]}
"""


def main() -> None:
    out = ROOT / "corpus"
    shutil.rmtree(out, ignore_errors=True)
    for name in ("graph_file", "graph_document", "op_graph", "profile", "cluster", "job_config", "plan", "trace"):
        (out / name).mkdir(parents=True)
    cluster = (ROOT.parent / "examples" / "clusters" / "mixed-generations.toml").read_text()
    torch.manual_seed(0)
    for case_name, case in (("mlp", zoo.mlp(batch=4)), ("gpt2", zoo.gpt2(batch=2, seq=4, hidden=8, vocab=16, layers=1))):
        graph = conveyor.capture(case.model, case.args, case.kwargs)
        graph.save(out / "graph_file" / f"{case_name}.cvg")
        graph.save(out / "graph_file" / f"{case_name}-no-weights.cvg", weights=False)
        (out / "graph_document" / f"{case_name}.json").write_text(graph.ir.to_json())
        prof = profile(graph, case.args, case.kwargs, repeats=1, warmup=0)
        (out / "profile" / f"{case_name}.json").write_text(json.dumps(prof))
        p = plan(graph, prof, cluster, batch=4)
        p.save(out / "plan" / f"{case_name}.json")
        subprocess.run([str(TOOL), "simulate", "--plan", str(out / "plan" / f"{case_name}.json"),
                        "--trace", str(out / "trace" / f"{case_name}.pftrace")], check=True, capture_output=True)
    (out / "op_graph" / "several-outputs.json").write_text(OP_GRAPH)
    for toml in (ROOT.parent / "examples" / "clusters").glob("*.toml"):
        shutil.copy(toml, out / "cluster" / toml.name)
    for toml in (ROOT.parent / "examples" / "jobs").glob("*.toml"):
        shutil.copy(toml, out / "job_config" / toml.name)
    for d in sorted(out.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds, {sum(f.stat().st_size for f in d.iterdir())} bytes")


if __name__ == "__main__":
    sys.exit(main())
