"""Activation recomputation: a stage that recomputes fully keeps only its inputs between its
forward and its backward and runs its forward again before the backward; selectively, it
keeps nothing of its cheap operators (elementwise, softmax, dropout, attention) and runs
those again. Every model of the zoo trains with either in every stage exactly like eager
(float64): BatchNorm's running statistics are updated once, in-place writes to a stage's
inputs are replayed from the inputs as they were, and dropout masks are drawn again from the
same seeded generators, so a model with dropout trains exactly like conveyor without
recomputation."""
import copy

import pytest
import torch

import conveyor
from conftest import split_batch
import zoo

TOLERANCE = 1e-9


def train_both(case, stages: int, schedule: str, recompute, steps: int = 2):
    """(conveyor.Module over case.model, the eager copy) after `steps` steps on the case's
    batch: 2 microbatches, one replica a stage, SGD."""
    ref = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=stages, replicas=1,
                            microbatches=2, schedule=schedule, recompute=recompute, replan="off")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batch = next(t for t in [*case.args, *case.kwargs.values()] if isinstance(t, torch.Tensor)).shape[0]
    losses, want = [], []
    threads = torch.get_num_threads()
    for _ in range(steps):
        losses.append(model.train_step(*case.args, **case.kwargs).item())
        ref_opt.zero_grad(set_to_none=True)
        torch.set_num_threads(model.job.threads_per_device())  # as a stage replica runs
        try:
            total = 0  # summed in the loss's own dtype (transformers' losses are float32), as the pipeline does
            for a, k in split_batch(case.args, case.kwargs, 2, batch):
                rows = next(t for t in [*a, *k.values()] if isinstance(t, torch.Tensor)).shape[0]
                part = case.share_loss(ref, a, k, rows, batch, case.counted_tokens(case.kwargs))
                part.backward()
                total = total + part.detach()
        finally:
            torch.set_num_threads(threads)
        want.append(total.item())
        ref_opt.step()
    return model, ref, losses, want


def node_lists(case, stages: int, args=None, kwargs=None) -> list:
    """A fixed cut of the case's model as conveyor.Module captures it, in capture order (two
    Modules given it run the same stages whatever their profiles measure)."""
    from conveyor.loss_wrapper import loss_wrapper
    args = case.args if args is None else args
    kwargs = case.kwargs if kwargs is None else kwargs
    graph = conveyor.capture(loss_wrapper(case.model, None, args, kwargs), args, kwargs)
    return graph.random_partition(stages, seed=0, keep_node_order=True)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module, what: str):
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        if not p.is_floating_point():
            assert torch.equal(p, q), f"{what}: {n} differs"
            continue
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, f"{what}: {n} differs by {err:.2e}"


@pytest.mark.parametrize("name", [n for n in zoo.CASES if zoo.CASES[n]().deterministic])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_the_zoo_trains_like_eager_with_every_stage_recomputing(name, schedule, recompute):
    torch.manual_seed(0)
    case = zoo.CASES[name]()
    model, ref, losses, want = train_both(case, stages=3, schedule=schedule, recompute=recompute)
    assert losses == pytest.approx(want, rel=TOLERANCE, abs=0)
    assert_same_state(case.model, ref, f"{name} {schedule} {recompute}")  # weights and running statistics alike


@pytest.mark.parametrize("name", [n for n in zoo.CASES if not zoo.CASES[n]().deterministic])
def test_dropout_draws_the_same_masks_when_recomputed(name):
    """With dropout the masks are conveyor's (seeded per stage, microbatch and step), not
    eager's: recomputing must draw them again identically, so the run equals conveyor's own
    without recomputation, bit for bit. The stages are fixed and the pipeline's seed drawn
    from torch's generator right before it is built (a planned cut would depend on timings)."""
    runs = []
    for recompute in (False, True, "selective"):
        torch.manual_seed(0)
        case = zoo.CASES[name]()
        stages = node_lists(case, 2)
        model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=stages,
                                microbatches=2, schedule="1f1b", recompute=recompute, replan="off")
        torch.manual_seed(1)  # the pipeline's seed
        losses = [model.train_step(*case.args, **case.kwargs).item() for _ in range(3)]
        runs.append((losses, case.model))
    (plain, a), *recomputed = runs
    for losses, b in recomputed:
        assert plain == losses
        for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(p, q), n


def test_recomputing_some_stages_and_bad_flags():
    torch.manual_seed(0)
    case = zoo.gpt2()
    _, ref, losses, want = train_both(case, stages=3, schedule="1f1b", recompute=[True, False, "selective"])
    assert losses == pytest.approx(want, rel=TOLERANCE, abs=0)
    assert_same_state(case.model, ref, "gpt2, stage 0 recomputing fully, stage 2 selectively")
    with pytest.raises(conveyor.ConveyorValueError, match="recompute has 2 flags but the pipeline has 3 stages"):
        conveyor.Module(zoo.mlp().model, stages=3, recompute=[True, False])(*zoo.mlp().args)
    with pytest.raises(conveyor.ConveyorValueError, match="expected True"):
        conveyor.Module(zoo.mlp().model, recompute="yes")


def cluster_toml(memory_bytes: float, devices: int = 2) -> str:
    return (f'name = "tight"\n[[node]]\ndevices = {devices}\nmemory = {memory_bytes:.0f}\n'
            '[link.intra_node]\nbandwidth = "10 GB/s"\nlatency = "10 us"\n')


def smallest_memory(graph, prof, recompute: str | None, **options) -> float:
    """The least memory a device needs for some plan to exist, by bisection on the planner
    (with the options conveyor.Module plans a batch of 8 with, under SGD: no optimizer state;
    `options` replace or add to them)."""
    options = {"max_microbatches": 4, **options}

    def fits(memory):
        try:
            conveyor.plan(graph, prof, cluster_toml(memory), batch=8, recompute=recompute, even_shares=True,
                          optimizer_state=0.0, **options)
            return True
        except conveyor.DoesNotFitError:
            return False
    lo, hi = 1.0, 1.0
    while not fits(hi):
        lo, hi = hi, hi * 2
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def train_eager_alike(case, ref, model, losses, shares: int, batch: int = 8):
    """Trains `ref` (the eager copy) as `model` was trained, the batch cut in `shares` (each
    share's loss averaged), and checks `losses` (the model's, one per step) against eager's."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    threads = torch.get_num_threads()
    for step in range(len(losses)):
        ref_opt.zero_grad(set_to_none=True)
        torch.set_num_threads(model.job.threads_per_device())
        try:
            total = 0
            for a, k in split_batch(case.args, case.kwargs, shares, batch):
                part = case.loss(ref(*a, **k)) / shares
                part.backward()
                total = total + part.detach()
        finally:
            torch.set_num_threads(threads)
        assert losses[step] == pytest.approx(total.item(), rel=TOLERANCE, abs=0)
        ref_opt.step()


def test_a_model_that_fits_only_by_recomputing_is_planned_so_and_trains_exactly(tmp_path):
    """On a cluster whose devices hold less than any plan keeping its activations needs (but
    more than one that recomputes needs), the planner makes stages recompute, the plan says
    which, and the Module trains on it exactly like eager."""
    from conveyor.loss_wrapper import loss_wrapper
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8)
    graph = conveyor.capture(loss_wrapper(case.model, None, case.args, case.kwargs), case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs, cache=False)
    keeping, recomputing = smallest_memory(graph, prof, "none"), smallest_memory(graph, prof, None)
    assert recomputing < keeping, (recomputing, keeping)  # the tiny GPT-2 is mostly weights: a few %
    memory = (keeping + recomputing) / 2
    with pytest.raises(conveyor.DoesNotFitError):  # keeping every activation, nothing fits there
        conveyor.plan(graph, prof, cluster_toml(memory), batch=8, recompute="none", even_shares=True,
                      max_microbatches=4, optimizer_state=0.0)
    ref = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), cluster=cluster_toml(memory),
                            replan="off")
    losses = [model.train_step(*case.args, **case.kwargs).item() for _ in range(2)]
    flags = [s["recompute"] for s in model.plan.document["stages"]]
    print(f"needs {keeping / 2**20:.2f} MiB a device keeping activations, {recomputing / 2**20:.2f} MiB "
          f"recomputing; on {memory / 2**20:.2f} MiB:\n{model.plan.table}")
    assert any(f != "none" for f in flags), model.plan.table
    assert all(f in model.plan.table for f in flags if f != "none"), model.plan.table
    assert all(s["memory_bytes"] <= memory for s in model.plan.document["stages"])
    # Eager with the plan's microbatches and replicas (the loss of each share, averaged).
    train_eager_alike(case, ref, model, losses, model.plan.microbatches * model.plan.replicas[-1])
    assert_same_state(case.model, ref, "gpt2 planned to recompute")


def test_where_selective_recomputation_is_enough_the_plan_takes_it_trains_exactly_and_meets_its_memory():
    """A GPT-2 whose attention scores and MLP activations outweigh its weights, cut in two
    GPipe stages of 4 microbatches (each keeps all four), on devices with room for what
    selective recomputation keeps but not for every activation: a stage recomputes its cheap
    operators, the plan says so, training equals eager, and each device's measured peak is at
    most 10% above the plan's and not far below it. The cut follows this machine's timings;
    across 19 cuts of this model (tools/selective_memory_by_cut.py) measured/predicted ran
    0.76 to 1.06, the lowest where a cut splits an attention's run of cheap operators."""
    from conveyor.loss_wrapper import loss_wrapper
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8, seq=128)
    graph = conveyor.capture(loss_wrapper(case.model, None, case.args, case.kwargs), case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs, cache=False)
    assert sum(n["selective_freed_bytes"] for n in prof["nodes"]) > 0.3 * sum(n["saved_bytes"] for n in prof["nodes"])

    gpipe = dict(microbatches=4, ranks=2, schedules=["gpipe"])
    keeping, selective = smallest_memory(graph, prof, "none", **gpipe), smallest_memory(graph, prof, "selective", **gpipe)
    assert selective < 0.9 * keeping, (selective, keeping)
    memory = keeping - 0.2 * (keeping - selective)
    ref = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), cluster=cluster_toml(memory),
                            stages=2, microbatches=4, schedule="gpipe", replan="off")
    losses = [model.train_step(*case.args, **case.kwargs).item() for _ in range(2)]
    flags = [s["recompute"] for s in model.plan.document["stages"]]
    report = model.profile_report()
    print(f"{keeping / 2**20:.2f} MiB a device keeping activations, {selective / 2**20:.2f} MiB recomputing "
          f"selectively; on {memory / 2**20:.2f} MiB:\n{model.plan.table}")
    for r in report.memory:
        print(f"rank {r['rank']}: measured {r['measured_bytes'] / 2**20:.3f} MiB, predicted "
              f"{r['predicted_bytes'] / 2**20:.3f} MiB ({r['measured_bytes'] / r['predicted_bytes']:.3f})")
    assert "selective" in flags and "selective" in model.plan.table, model.plan.table
    assert all(s["memory_bytes"] <= memory for s in model.plan.document["stages"])
    for r in report.memory:
        assert 0.7 <= r["measured_bytes"] / r["predicted_bytes"] <= 1.1, r
    train_eager_alike(case, ref, model, losses, 4)
    assert_same_state(case.model, ref, "gpt2 planned to recompute selectively")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
@pytest.mark.parametrize("name", ["cnn_batchnorm", "gpt2"])
def test_cuda_recomputation_trains_like_keeping_the_activations(name):
    """On a GPU (the replicas' own streams): every stage recomputing trains like the same
    pipeline keeping its activations, to 1e-9 (gradients that are zero in exact arithmetic
    judged against a millionth of the largest)."""
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        case = zoo.CASES[name]()
        case.model.cuda()
        args = tuple(a.cuda() for a in case.args)
        kwargs = {k: v.cuda() for k, v in case.kwargs.items()}
        model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05),
                                stages=node_lists(case, 3, args, kwargs), microbatches=2, schedule="1f1b",
                                recompute=recompute, replan="off")
        losses = [model.train_step(*args, **kwargs).item() for _ in range(2)]
        runs.append((losses, case.model))
    (kept, a), (recomputed, b) = runs
    assert recomputed == pytest.approx(kept, rel=TOLERANCE, abs=0)
    assert_same_state(b, a, f"{name} on CUDA")
