"""Packed microbatches (bindings/conveyor/microbatches.py): one step over microbatches the
caller made, each with its own rows and sequence length (attention masks for the padding
inside each), trains exactly like eager on the same microbatches, each loss (a mean over its
counted tokens) weighted by its tokens over the step's (float64, 1e-9), under 1F1B and ZB-H1, with replicas, in one process and in two; a bad
microbatch is refused before anything runs, naming it."""
import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import conveyor
import zoo
from conveyor import _C

TOLERANCE = 1e-9
# Each step: (rows, sequence length) per microbatch.
STEPS = [[(4, 8), (2, 12)], [(3, 20), (5, 7)], [(2, 12), (4, 8)]]


def packed_like_eager(case, model, steps, generator):
    """Trains `model` (a conveyor.Module over case.model) and an eager copy on the same packed
    steps; returns the largest relative difference of the losses and of the weights."""
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    worst = 0.0
    threads = torch.get_num_threads()
    for shapes in steps:
        microbatches = [zoo.padded_tokens(rows, seq, 96, generator=generator) for rows, seq in shapes]
        loss = model.train_step(conveyor.Microbatches(microbatches)).item()
        ref_opt.zero_grad(set_to_none=True)
        total, tokens = 0, sum(_counted(mb) for mb in microbatches)
        torch.set_num_threads(model.job.threads_per_device())
        try:
            for mb in microbatches:
                part = case.loss(ref(**mb, num_items_in_batch=tokens))  # the step's mean over its tokens
                part.backward()
                total = total + part.detach()  # in the loss's own dtype, as the pipeline sums
        finally:
            torch.set_num_threads(threads)
        ref_opt.step()
        worst = max(worst, abs(loss - total.item()) / abs(total.item()))
    for p, q in zip(case.model.parameters(), ref.parameters()):
        worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


def _counted(microbatch: dict) -> int:
    """The tokens a causal LM's loss counts: labels shifted by one, -100 (padding) not counted."""
    return int((microbatch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule,replicas", [("1f1b", 1), ("zb-h1", 1), ("1f1b", [2, 1])])
def test_packed_microbatches_of_other_lengths_train_like_eager(name, schedule, replicas):
    torch.manual_seed(0)
    case = zoo.CASES[name](batch=4, seq=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2,
                            replicas=replicas, microbatches=2, schedule=schedule, replan="off",
                            max_sizes={"input_ids dim 1": 20, "labels dim 1": 20})
    worst = packed_like_eager(case, model, STEPS, torch.Generator().manual_seed(1))
    print(f"{name} {schedule} replicas {replicas}: worst relative difference {worst:.2e}; "
          f"{model.capture_count} capture(s)")
    assert worst <= TOLERANCE
    assert model.capture_count <= 1  # one graph holds every length


def test_more_microbatches_than_the_plan_runs_on_its_stages():
    """Three packed microbatches on a plan of two: the same stages and replicas run three."""
    torch.manual_seed(0)
    case = zoo.gpt2(batch=4, seq=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2, replicas=1,
                            microbatches=2, schedule="1f1b", replan="off", max_sizes={"input_ids dim 1": 20,
                                                                                      "labels dim 1": 20})
    steps = [[(2, 8), (3, 12), (2, 20)], [(4, 7), (2, 9), (3, 8)]]
    assert packed_like_eager(case, model, steps, torch.Generator().manual_seed(2)) <= TOLERANCE
    assert model.microbatches == 2  # the plan's own steps keep theirs


def test_a_module_first_called_with_packed_microbatches_plans_for_them():
    """Nothing fixed but the stages: the first step's microbatches are the plan's count, its
    rows its batch, and its longest microbatch the size its memory is made for, so the next
    steps (no longer) run on that plan without planning again; every step equals eager."""
    torch.manual_seed(0)
    case = zoo.gpt2(batch=4, seq=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2)
    steps = [[(2, 8), (3, 20), (2, 12)], [(4, 7), (2, 16), (3, 8)]]
    assert packed_like_eager(case, model, steps, torch.Generator().manual_seed(3)) <= TOLERANCE
    print(model.plan)
    assert model.microbatches == 3 and model.plan.document["batch"] == 7
    assert model.capture.planned_sizes == {"input_ids dim 1": 20, "labels dim 1": 20}
    assert model.replans == []


def test_a_bad_microbatch_is_refused_naming_it():
    torch.manual_seed(0)
    case = zoo.gpt2(batch=4, seq=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2, replicas=1,
                            microbatches=2, replan="off")
    g = torch.Generator().manual_seed(1)
    good = zoo.padded_tokens(4, 8, 96, generator=g)
    model.train_step(**good)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = dict(good, input_ids=good["input_ids"].double())
    with pytest.raises(conveyor.ConveyorValueError, match=r"microbatch 1.*dtype float64 .* captured with int64"):
        model.train_step(conveyor.Microbatches([good, bad]))
    # Beyond the 128 positions the model has: no guard of the capture bounds it, so its
    # forward fails (F1: microbatch 1's), and the step with it, before the optimizer runs.
    long = zoo.padded_tokens(2, 200, 96, generator=g)
    forward_fails = r"at the forward of microbatch 1 \(F1\): .*aten::embedding.*index out of range"
    with pytest.raises(conveyor.ExecutionError, match=forward_fails):
        model.train_step(conveyor.Microbatches([good, long]))
    with pytest.raises(conveyor.ConveyorValueError, match=r"microbatch 0 is a list"):
        conveyor.Microbatches([[good["input_ids"]]])
    with pytest.raises(conveyor.ConveyorValueError, match="at least one"):
        conveyor.Microbatches([])
    model.eval()
    with pytest.raises(conveyor.ConveyorValueError, match="to evaluate, call the model on each batch"):
        model(conveyor.Microbatches([good, good]))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused step"


WORKER = Path(__file__).with_name("launch_worker.py")
BUILD = os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_two_processes_train_packed_microbatches_like_one(tmp_path):
    """Under `conveyor launch -n 2` (a stage per process) packed microbatches of lengths 8, 12,
    20 and 7 train to the same losses and weights as one process running the same plan."""
    from test_launch import assert_trains_like_one_process, launch
    tool = os.path.join(BUILD, "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    common = ["--case", "gpt2", "--batch", "8", "--lengths", "8,12,20,7", "--microbatches", "2", "--packed",
              "--schedule", "1f1b"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *common, "--stages", "2", "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    assert_trains_like_one_process(tmp_path / "two.pt", 2, [*common, "--plan", tmp_path / "two.pt.plan.json"],
                                   tmp_path)
