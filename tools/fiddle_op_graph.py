#!/usr/bin/env python3
"""Converts a training graph of the public device-placement benchmark "Efficient Algorithms
for Device Placement of DNN Graph Operators" (NeurIPS 2020, github.com/msr-fiddle/
dnn-partitioning, MIT licence; its throughput-inputs/*Graphs/*_training.json) into a
conveyor op-graph document (docs/formats.md), for planning without a captured model:

    python3 tools/fiddle_op_graph.py bert_l-3_training.json > examples/op_graphs/bert_l-3.json

Its documents list forward and backward nodes with their accelerator latency (ms), the
edges between them with the bytes they carry, and a colour class that ties a backward node
to the forward node whose gradient it computes. The op-graph keeps the forward nodes in a
topological order (ties by id), each with:
- forward_s: its latency; backward_s: the latency of the backward nodes of its colour class
  (split evenly among the forward nodes sharing it; a backward node whose class has no
  forward node goes to the latest forward node feeding it, else to the last one);
- output_bytes: the largest edge it sends to a forward node; inputs: its forward predecessors;
- saved_bytes: the bytes it sends to backward nodes (what its backward keeps);
- params: operator graphs give weights as source nodes without latency; they become
  parameters of the forward nodes that read them. Layer graphs give each layer's memory as
  its size, which becomes a parameter of that layer.
Their model sends a value between devices at 2^31 bytes/s (edge cost = bytes / 2^31 s), so
tests plan these on a cluster whose link has that bandwidth and no latency."""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import defaultdict


def convert(doc: dict, name: str) -> dict:
    nodes = {n["id"]: n for n in doc["nodes"]}
    backward = {i for i, n in nodes.items() if n["isBackwardNode"]}
    preds, succs = defaultdict(list), defaultdict(list)
    for e in doc["edges"]:
        preds[e["destId"]].append(e)
        succs[e["sourceId"]].append(e)
    forward = [i for i in nodes if i not in backward]
    # Weights: forward source nodes without latency whose bytes only forward and backward
    # nodes read (operator graphs); everything else is an operator.
    operator_graph = any(n.get("fpgaLatency", 0) == 0 and n.get("size", 0) > 0 and not preds[i]
                         and n["name"].endswith(("weight", "bias", "weight_transposed")) for i, n in nodes.items())
    weights = {i for i in forward if operator_graph and not preds[i] and nodes[i]["fpgaLatency"] == 0
               and nodes[i].get("size", 0) > 0}
    ops = [i for i in forward if i not in weights]
    # A topological order of the forward operators (Kahn, smallest id first).
    ops_set = set(ops)
    indeg = {i: sum(1 for e in preds[i] if e["sourceId"] in ops_set) for i in ops}
    ready = [i for i in ops if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for e in succs[i]:
            j = e["destId"]
            if j in ops_set:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
    if len(order) != len(ops):
        raise SystemExit(f"{name}: the forward nodes form a cycle")
    position = {i: k for k, i in enumerate(order)}
    by_class = defaultdict(list)
    for i in order:
        if "colorClass" in nodes[i]:
            by_class[nodes[i]["colorClass"]].append(i)
    backward_s = defaultdict(float)
    for b in backward:
        latency = nodes[b]["fpgaLatency"] * 1e-3
        owners = by_class.get(nodes[b].get("colorClass"))
        if owners:
            for i in owners:
                backward_s[i] += latency / len(owners)
            continue
        feeding = [e["sourceId"] for e in preds[b] if e["sourceId"] in position]
        backward_s[max(feeding, key=position.get) if feeding else order[-1]] += latency
    params, param_index = [], {}
    for w in sorted(weights):
        param_index[w] = len(params)
        params.append({"name": nodes[w]["name"], "bytes": nodes[w]["size"]})
    out_ops = []
    for i in order:
        n = nodes[i]
        to_forward = [e["size"] for e in succs[i] if e["destId"] in ops_set]
        to_backward = [e["size"] for e in succs[i] if e["destId"] in backward]
        op = {"name": n["name"], "forward_s": n["fpgaLatency"] * 1e-3, "backward_s": backward_s[i],
              "output_bytes": max(to_forward, default=0.0),
              "inputs": sorted({position[e["sourceId"]] for e in preds[i] if e["sourceId"] in position})}
        if to_backward:
            op["saved_bytes"] = max(to_backward)
        reads = sorted({param_index[e["sourceId"]] for e in preds[i] if e["sourceId"] in param_index})
        if not operator_graph and n.get("size", 0) > 0:
            reads = [len(params)]
            params.append({"name": f"{n['name']} memory", "bytes": n["size"]})
        if reads:
            op["params"] = reads
        out_ops.append(op)
    return {"format": "conveyor.op-graph", "version": 1, "name": name, "microbatch": 1,
            "device": "the accelerator of msr-fiddle/dnn-partitioning's throughput inputs (latencies in ms there)",
            "params": params, "ops": out_ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a *_training.json of msr-fiddle/dnn-partitioning's throughput-inputs")
    ap.add_argument("--name", default=None, help="the op-graph's name (default: the file's stem)")
    args = ap.parse_args()
    with open(args.source) as f:
        doc = json.load(f)
    name = args.name or args.source.rsplit("/", 1)[-1].removesuffix(".json")
    json.dump(convert(doc, name), sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
