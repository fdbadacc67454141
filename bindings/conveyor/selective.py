"""What selective recomputation saves, as the profile measures it (docs/planner.md,
"Recomputation").

Selective recomputation (StageProgram.forward_selective) runs the graph's cheap operators
(elementwise math, softmax, dropout, attention between activations) again in the backward
and keeps nothing they saved, except the values they read from the operators it keeps. The
profile runs the graph unit by unit and sees, for each unit, the storages its backward saves;
this accounts, for each unit the recomputation runs again, the bytes it frees: the storages
made inside the unit (an attention's score matrix, a dropout's mask), and the values made by
recomputed operators that no kept operator saves as well, each once; less what each run keeps
that nothing kept before (its inputs).
"""
from __future__ import annotations

from typing import Any

import torch

from .document import node_value_inputs


class SelectiveAccounting:
    """Per unit of a profile: the forward time selective recomputation pays again and the
    saved bytes it frees (the profile's `selective_forward_s` and `selective_freed_bytes`)."""

    def __init__(self, graph, document: dict):
        self.runs = graph.executor.stage(list(range(graph.num_nodes))).selective_runs
        self.recomputed = {n for nodes, _ in self.runs for n in nodes}
        self.producer = {r["value"]: i for i, node in enumerate(document["nodes"])
                         for r in node["returns"] if "value" in r}
        self.readers: dict[int, set[int]] = {}
        for i, node in enumerate(document["nodes"]):
            for v in node_value_inputs(node):
                self.readers.setdefault(v, set()).add(i)
        self.outputs = set(document["outputs"]) if "outputs" in document else set()
        self.value_storages: dict[int, set[int]] = {}  # storage -> the graph values on it
        self.saved_by_kept: set[int] = set()
        self.saved: set[int] = set()  # by any unit
        self.units: dict[int, tuple[int, dict[int, int]]] = {}  # first node -> (bytes made inside, {value storage: bytes})

    def note_values(self, values: dict[int, Any], ids) -> None:
        """Values now alive (graph inputs, a unit's outputs): their storages stay theirs (the
        profile keeps every value alive to its end)."""
        for v in ids:
            t = values.get(v)
            if isinstance(t, torch.Tensor):
                self.value_storages.setdefault(t.untyped_storage().data_ptr(), set()).add(v)

    def note_unit(self, unit: list[int], inside: int, on_values: dict[int, int], kept_too: set[int]) -> None:
        """A unit's saved bytes as the profile counts them: `inside`, on storages made inside
        it; `on_values`, the graph values' storages that count for it, with their bytes;
        `kept_too`, every storage its backward saves."""
        self.saved.update(kept_too)
        if not all(n in self.recomputed for n in unit):
            self.saved_by_kept.update(kept_too)
            return
        self.units[unit[0]] = (inside, on_values)

    def finish(self, nodes: list[dict], values: dict[int, Any], measured_work: dict[int, float]) -> None:
        """Writes each recomputed unit's figures into its first node's profile entry. A run
        keeps the values it reads from before it; those nothing saved otherwise (a residual
        sum's operands) are a cost against what its units free. `measured_work`: a run's
        working memory as its recomputation and backward measured it (by its first node),
        which replaces the estimate here (its outputs and their gradients, and what it freed):
        the estimate missed every value the run makes again without saving it (a score
        matrix before its softmax, a loss's log-probabilities)."""
        counted: set[int] = set()
        freed: dict[int, float] = {}
        for first, (inside, on_values) in self.units.items():
            freed[first] = inside
            for ptr, b in on_values.items():
                kept_value = any(self.producer.get(v) not in self.recomputed for v in self.value_storages[ptr])
                if ptr in counted or ptr in self.saved_by_kept or kept_value:
                    continue
                counted.add(ptr)
                freed[first] += b
        kept: set[int] = set()
        kept_more: dict[int, float] = {}
        work: dict[int, float] = {}
        for run_nodes, inputs in self.runs:
            # Its backward makes its outputs again and holds their gradients meanwhile, beside
            # the activations it makes again (added below).
            inside = set(run_nodes)
            out_bytes = 0
            for v, n in self.producer.items():
                t = values.get(v)
                if n in inside and isinstance(t, torch.Tensor) and (
                        v in self.outputs or not self.readers.get(v, set()) <= inside):
                    out_bytes += t.numel() * t.element_size()
            work[run_nodes[0]] = 2.0 * out_bytes
            cost = 0
            for v in inputs:
                t = values.get(v)
                if not isinstance(t, torch.Tensor):
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.saved and ptr not in kept:
                    kept.add(ptr)
                    cost += t.untyped_storage().nbytes()
            for n in run_nodes:  # taken from the run's units in order, none below zero
                if n in freed and cost > 0:
                    take = min(cost, freed[n])
                    freed[n] -= take
                    cost -= take
            if cost > 0:  # it keeps more than it frees (a loss's logits for its log-probabilities)
                kept_more[run_nodes[0]] = kept_more.get(run_nodes[0], 0.0) + cost
        for run_nodes, _ in self.runs:  # and, while it runs again, what it had freed
            work[run_nodes[0]] += sum(freed.get(n, 0.0) for n in run_nodes)
        for first, amount in freed.items():
            nodes[first]["selective_forward_s"] = nodes[first]["forward_s"]
            nodes[first]["selective_freed_bytes"] = float(min(amount, nodes[first]["saved_bytes"]))
        # On every node of the run: a stage holding any part of it (a cut may split it) may
        # run all of it again at once, and holds it while its backward reaches the run's end.
        for run_nodes, _ in self.runs:
            amount = measured_work.get(run_nodes[0], work[run_nodes[0]])
            for n in run_nodes:
                nodes[n]["selective_work_bytes"] = amount
        for first, amount in kept_more.items():
            nodes[first]["selective_kept_bytes"] = float(amount)

