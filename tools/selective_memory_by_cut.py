#!/usr/bin/env python3
"""Measured against predicted peak memory of a two-stage GPT-2 recomputing selectively, at
every cut given: the model tests/python/test_recompute.py plans (8 sequences of 128 tokens,
width 32, 4 heads; GPipe, 4 microbatches), cut where asked rather than where this machine's
timings put it, so that the model's error is seen across cuts:

    ./run python tools/selective_memory_by_cut.py 60 70 80 90 100 110 120

A cut at node k is forced by pricing nodes k-1 and k far above the others; the plan is run
with conveyor.Module(plan=...) for one step and profile_report().memory is printed."""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import conveyor  # noqa: E402
import zoo  # noqa: E402
from conveyor.loss_wrapper import loss_wrapper  # noqa: E402
from test_recompute import cluster_toml  # noqa: E402


def main() -> int:
    cuts = [int(a) for a in sys.argv[1:]] or list(range(60, 130, 6))
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8, seq=128)
    graph = conveyor.capture(loss_wrapper(case.model, None, case.args, case.kwargs), case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs, cache=False)
    order = graph.random_partition(1, seed=0, keep_node_order=True)[0]
    ratios = []
    for k in cuts:
        priced = copy.deepcopy(prof)
        for i, node in enumerate(priced["nodes"]):
            heavy = i in (order[k - 1], order[k])
            node["forward_s"] = node["backward_s"] = 0.01 if heavy else 1e-7
            node["backward_weight_s"] = node["backward_s"] / 2
        plan = conveyor.plan(graph, priced, cluster_toml(1e9), batch=8, microbatches=4, recompute="selective",
                             even_shares=True, optimizer_state=0.0, max_microbatches=4, ranks=2, schedules=["gpipe"])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "plan.json")
            plan.save(path)
            torch.manual_seed(0)
            case = zoo.gpt2(batch=8, seq=128)
            model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), plan=path,
                                    replan="off")
            model.train_step(*case.args, **case.kwargs)
        rows = model.profile_report().memory
        ratios += [r["measured_bytes"] / r["predicted_bytes"] for r in rows]
        print(f"cut {'|'.join(str(len(s)) for s in plan.stage_nodes):7s} " + "  ".join(
            f"device {r['rank']}: {r['measured_bytes'] / 2**20:.2f} MiB measured, {r['predicted_bytes'] / 2**20:.2f} "
            f"predicted ({r['measured_bytes'] / r['predicted_bytes']:.3f})" for r in rows), flush=True)
    inside = sum(0.9 <= r <= 1.1 for r in ratios)
    print(f"measured/predicted {min(ratios):.3f} to {max(ratios):.3f}; {inside} of {len(ratios)} within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
