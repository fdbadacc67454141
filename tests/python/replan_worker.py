"""A training script that changes plan while it trains, for tests/python/test_replan.py:
plan A (conveyor's own), then B (two stages), then C (three stages, the middle one
replicated with uneven shares of each microbatch, 3 samples and 1, 1F1B), then D (four
stages, ZB-H1), a few steps each, cut at random valid places in node order, the switches forced with Module.switch_plan. Alone
or under `conveyor launch`; process 0 writes the losses and the gathered model state.

    conveyor launch -n 2 -- python replan_worker.py --optimizer adam --out result.pt
"""
import argparse
import copy
import json
import os

import torch

import conveyor
import zoo


def optimizer_for(name: str, params):
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(name)


def plan_with(model: conveyor.Module, parts: list, replicas: list, schedule: str, microbatches: int,
              shares: dict | None = None) -> conveyor.Plan:
    """A plan of `model`'s graph cut into `parts` (node lists), `replicas` per stage, on as
    many devices as replicas in all; `shares` by stage where a stage's replicas take uneven
    shares of a microbatch (else even)."""
    doc = copy.deepcopy(model.plan.document)
    template = dict(doc["stages"][0])
    stages, first = [], 0
    for s, (nodes, r) in enumerate(zip(parts, replicas)):
        stages.append(dict(template, ops=sorted(nodes), replicas=r, first_device=first,
                           shares=(shares or {}).get(s, [1 / r] * r)))
        first += r
    device = doc["devices"][0]
    link = doc["links"][0] if doc.get("links") else {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6}
    doc.update(stages=stages, schedule=schedule, microbatches=microbatches, chunks=1, devices=[device] * first,
               links=[link] * (len(replicas) - 1))
    return conveyor.Plan(conveyor._C.read_plan(json.dumps(doc)), f"(a plan of {len(replicas)} stages for the test)")


def cuts(graph) -> list:
    """The stages of B, C and D: C a random valid cut into 3 in node order (seed 9: a middle
    stage holding most blocks, cut where no value without a batch dimension crosses), B cut
    in the middle of C's middle stage, D a random valid cut into 4. Across two processes
    each process then lacks half of C's middle stage, which the other holds: that moves."""
    c = graph.random_partition(3, seed=9, keep_node_order=True)
    cut = c[1][len(c[1]) // 2]
    while True:  # the first valid cut from the middle on
        b = [c[0] + [n for n in c[1] if n < cut], [n for n in c[1] if n >= cut] + c[2]]
        try:
            graph._ir.check_partition(b)
            break
        except Exception:
            cut += 1
    return [b, c, graph.random_partition(4, seed=2, keep_node_order=True)]


def two_stage_cut(graph, cut: int) -> list:
    """Two stages in node order, the second from the first valid cut at or after node `cut`."""
    nodes = sorted(n for stage in graph.random_partition(1, seed=0, keep_node_order=True) for n in stage)
    while True:
        parts = [[n for n in nodes if n < cut], [n for n in nodes if n >= cut]]
        try:
            graph._ir.check_partition(parts)
            return parts
        except Exception:
            cut += 1


def swap_cuts(graph) -> list:
    """Two plans of two stages: the first cut at a quarter of the nodes, the second at three
    quarters. Across two processes, process 0 then takes over the middle half, which it
    released under the first."""
    n = sum(len(stage) for stage in graph.random_partition(1, seed=0, keep_node_order=True))
    return [two_stage_cut(graph, n // 4), two_stage_cut(graph, 3 * n // 4)]


# The plans the run goes through after conveyor's own: (replicas per stage, schedule,
# microbatches, uneven shares by stage); their stages are cuts()'s.
LAYOUTS = [([1, 1], "1f1b", 2, None), ([1, 2, 1], "1f1b", 2, {1: [0.75, 0.25]}), ([1, 1, 1, 1], "zb-h1", 4, None)]
SWAP_LAYOUTS = [([1, 1], "1f1b", 2, None), ([1, 1], "1f1b", 2, None)]  # swap_cuts()'s


class DieWhenSaved:
    """Optimizer state that ends its process when pickled: the move hands state over by
    pickling it, so a process holding this dies in the middle of a move."""

    def __reduce__(self):
        os._exit(3)


def train(case_name: str, optimizer_name: str, batch: int, steps_per_plan: int,
          loop: str = "train_step", swap: bool = False) -> tuple[list, dict, object, list]:
    """Returns (losses, the gathered state, the Module, and per step the pieces its loss ran
    on: microbatches times the last stage's replicas). `loop`: "train_step", or "readme": the
    README's loop (call, backward, optimizer step, zero_grad), its last loss alive through
    each switch and the next call, as a user's loop variable is. `swap`: swap_cuts()'s plans
    rather than LAYOUTS."""
    torch.manual_seed(0)
    case = zoo.CASES[case_name](batch=batch)
    optimizer = optimizer_for(optimizer_name, case.model.parameters())
    model = conveyor.Module(case.model, optimizer, loss_fn=case.loss, replan="off", devices=2)
    losses, microbatches = [], []
    moves = []  # per switch across processes: (bytes of tensors this process lacked, bytes it received)
    layouts, stages_of = (SWAP_LAYOUTS, swap_cuts) if swap else (LAYOUTS, cuts)
    for k in range(len(layouts) + 1):
        if k:
            if os.environ.get("REPLAN_WORKER_DIE_IN_MOVE"):
                for p in case.model.parameters():
                    if p.numel():
                        optimizer.state[p]["die"] = DieWhenSaved()
            replicas, schedule, m, shares = layouts[k - 1]
            before = model.capture.pipeline.readers()
            model.switch_plan(plan_with(model, stages_of(model.capture.graph)[k - 1], replicas, schedule, m,
                                        shares=shares))
            if model.world_size > 1:  # what this process lacked of what it now reads, whole until the next step
                after, me, tensors = model.capture.pipeline.readers(), model.rank, model.capture.graph.tensors
                lacked = sum(tensors[n].nbytes for n, r in after.items() if me in r and me not in before.get(n, []))
                moves.append((lacked, model.replans[-1]["received_tensor_bytes"]))
        for _ in range(steps_per_plan):
            if loop == "readme":
                loss = model(*case.args, **case.kwargs)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                loss = model.train_step(*case.args, **case.kwargs)
            losses.append(loss.item())
        if k and layouts[k - 1][3]:  # the runtime splits by the plan's shares: 3 samples and 1 of 4
            assert model.capture.pipeline.share_lengths(1, 4) == [3, 1], model.capture.pipeline.share_lengths(1, 4)
        # The loss runs on each share of the last stage's replicas: the pieces eager must match.
        microbatches += [model.microbatches * model.capture.layout[4][-1]] * steps_per_plan
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # every process takes part
    model.moves = moves
    return losses, state, model, microbatches


def eager(case_name: str, optimizer_name: str, batch: int, microbatches: list) -> tuple[list, dict]:
    """The same model trained eagerly with gradient accumulation over `microbatches[k]`
    microbatches in step k (transformers computes its loss in float32: the split matters)."""
    torch.manual_seed(0)
    case = zoo.CASES[case_name](batch=batch)
    optimizer = optimizer_for(optimizer_name, case.model.parameters())
    losses = []
    for m in microbatches:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(m):
            lo, hi = i * batch // m, (i + 1) * batch // m
            part = [a[lo:hi] if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch else a
                    for a in case.args]
            kw = {k: (v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v)
                  for k, v in case.kwargs.items()}
            loss = case.loss(case.model(*part, **kw)) * ((hi - lo) / batch)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in case.model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="gpt2")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps-per-plan", type=int, default=2)
    ap.add_argument("--loop", choices=["train_step", "readme"], default="train_step")
    ap.add_argument("--swap", action="store_true", help="swap_cuts()'s plans rather than LAYOUTS")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    losses, state, model, microbatches = train(args.case, args.optimizer, args.batch, args.steps_per_plan, args.loop,
                                               args.swap)
    moves = [json.loads(model.job.group.broadcast_bytes(p, json.dumps(model.moves).encode() if p == model.rank else b""))
             for p in range(model.world_size)]  # per process, per switch
    if model.rank == 0:
        torch.save({"losses": losses, "state": state, "world": model.world_size, "replans": model.replans,
                    "microbatches": microbatches, "moves": moves}, args.out)


if __name__ == "__main__":
    main()
