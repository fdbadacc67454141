"""Variable shapes: capture keeps every size the model allows symbolic (a sequence length, an
image's height and width), so one capture trains batches of any such size exactly like eager
(float64), in one process and in two; a size outside what the capture holds, or inputs that
disagree on a size, are refused before anything runs, naming the input and the size. Other
values of a call's non-tensor arguments get captures of their own."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conveyor
from conftest import split_batch
from launch_worker import BranchesOnLength
import zoo
from conveyor import _C

LENGTHS = (8, 12, 20, 7)
TOLERANCE = 1e-9


def train_like_eager(case, model, batches, shares: int, momentum: float = 0.0):
    """Trains `model` (a conveyor.Module over case.model) and an eager copy on `batches`,
    each step's loss the mean of `shares` equal parts of the batch (what the pipeline's
    microbatches and last-stage replicas compute) or, for a causal LM's padded labels, the sum
    over its parts of their tokens' losses over the batch's tokens (the whole batch's mean,
    counted_targets.py), and checks losses and weights."""
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum)
    threads = torch.get_num_threads()
    for args, kwargs in batches:
        batch = next(t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)).shape[0]
        loss = model.train_step(*args, **kwargs)
        ref_opt.zero_grad(set_to_none=True)
        want = 0
        # Eager at the intra-op threads of a stage replica: Llama's RMSNorm computes in
        # float32 even in a float64 model, and its reductions' order follows the threads.
        torch.set_num_threads(model.job.threads_per_device())
        try:
            tokens = int((kwargs["labels"][:, 1:] != -100).sum()) if "labels" in kwargs else None
            for a, k in split_batch(args, kwargs, shares, batch):
                part = (case.loss(ref(*a, **k, num_items_in_batch=tokens)) if tokens is not None else
                        case.loss(ref(*a, **k)) / shares)
                part.backward()
                want = want + part.detach()
        finally:
            torch.set_num_threads(threads)
        ref_opt.step()
        assert abs(loss.item() - want.item()) <= TOLERANCE * abs(want.item())
    for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, f"{n} differs by {err:.2e}"


@pytest.mark.parametrize("name,stages,replicas,schedule", [
    ("gpt2", 2, 1, "1f1b"), ("gpt2", 3, 2, "zb-h1"), ("llama", 2, 2, "1f1b"), ("llama", 3, [1, 2, 1], "zb-h1")])
def test_token_models_train_on_every_sequence_length_with_one_capture(name, stages, replicas, schedule):
    """Padded batches of lengths 8, 12, 20 and 7 (attention masks, labels ignored on the
    padding): one capture, every length trains like eager."""
    torch.manual_seed(0)
    case = zoo.CASES[name](batch=8, seq=12)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=stages,
                            replicas=replicas, microbatches=2, schedule=schedule, replan="off")
    draws = torch.Generator().manual_seed(1)
    batches = [((), zoo.padded_tokens(8, n, 96, draws)) for n in LENGTHS]
    last_replicas = replicas[-1] if isinstance(replicas, list) else replicas
    train_like_eager(case, model, batches, shares=2 * last_replicas)
    symbols = model.capture.graph.document["symbols"]
    print(f"{name}: {len(LENGTHS)} lengths, 1 capture, symbolic sizes {sorted(symbols.values())}, "
          f"{model.extra_repr()}")
    assert "input_ids dim 1" in symbols.values(), symbols


def test_lengths_beyond_the_first_plan_train_like_eager_on_plans_made_for_them():
    """With re-planning on (the default), 12 and then 20 tokens after a first batch of 8 each
    plan again for the larger length before their step (the model's parameters and SGD's
    momentum carried over): every step equals eager."""
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8, seq=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05, momentum=0.9), stages=2,
                            microbatches=2, schedule="1f1b")
    draws = torch.Generator().manual_seed(1)
    batches = [((), zoo.padded_tokens(8, n, 96, draws)) for n in LENGTHS]
    train_like_eager(case, model, batches, shares=2, momentum=0.9)
    print("\n".join(f"step {r['step']}: {r['reason']}: {r['old']} -> {r['new']}" for r in model.replans))
    assert [r["step"] for r in model.replans] == [1, 2]
    assert model.capture.planned_sizes["input_ids dim 1"] == 20


@pytest.mark.parametrize("stages,replicas,schedule", [(2, 2, "1f1b"), (3, 1, "zb-h1")])
def test_a_vision_model_trains_on_two_image_sizes_with_one_capture(stages, replicas, schedule):
    torch.manual_seed(0)
    case = zoo.resnet18(batch=8, image=48)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=stages,
                            replicas=replicas, microbatches=2, schedule=schedule, replan="off")
    draws = torch.Generator().manual_seed(1)
    batches = [((torch.randn(8, 3, h, w, generator=draws, dtype=torch.float64),
                 torch.randint(0, 10, (8,), generator=draws)), {}) for h, w in ((48, 48), (64, 40), (48, 48))]
    # BatchNorm normalizes over each replica's share: the eager reference does the same.
    train_like_eager(case, model, batches, shares=2 * replicas)
    roles = set(model.capture.graph.document["symbols"].values())
    assert roles == {"batch", "x dim 2", "x dim 3"}, roles
    # Captured at 32 pixels the network ends at 1x1, and torch.export bounds the size there:
    # a larger image is refused naming the bound.
    small = zoo.resnet18(batch=4, image=32)
    graph = conveyor.capture(small.model, small.args)
    with pytest.raises(conveyor.ConveyorValueError, match=r"has x dim 2 \(s\w+\) = 48 but the graph holds for 2 to 32"):
        graph(torch.randn(4, 3, 48, 48, dtype=torch.float64), small.args[1])


def test_sizes_the_capture_does_not_hold_are_refused_naming_them():
    torch.manual_seed(0)
    case = zoo.gpt2(batch=4, seq=12)
    graph = conveyor.capture(case.model, (), case.kwargs)
    ids = torch.randint(0, 96, (4, 12))
    with pytest.raises(conveyor.ConveyorValueError, match=r"disagree on input_ids dim 1 \(s\w+\): 12 and 10"):
        graph(input_ids=ids, labels=ids[:, :10])
    with pytest.raises(conveyor.ConveyorValueError,
                       match=r"has input_ids dim 1 \(s\w+\) = 1 but the graph holds for 2 and more only"):
        graph(input_ids=ids[:, :1], labels=ids[:, :1])
    # A size the model fixes (the feature width of an MLP) is named with what may change.
    mlp = zoo.mlp(batch=8)
    graph = conveyor.capture(mlp.model, mlp.args)
    with pytest.raises(conveyor.ConveyorValueError, match=r"has shape \[8, 8\] but the graph was captured for "
                                                          r"\[s\w+, 16\] \(only batch may change\)"):
        graph(mlp.args[0][:, :8], mlp.args[1])


WORKER = Path(__file__).with_name("launch_worker.py")
BUILD = os.environ.get("CONVEYOR_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_two_processes_train_every_sequence_length_like_one(tmp_path, name):
    """Under `conveyor launch -n 2` (a stage per process, activations of every length
    crossing over UCX) the lengths train to the same losses and weights as one process
    running the same plan. The job plans again for 12 and for 20 tokens before their steps
    (collective: process 0 profiles the whole model gathered, every process switches)."""
    from test_launch import assert_trains_like_one_process, launch
    tool = os.path.join(BUILD, "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    common = ["--case", name, "--batch", "8", "--lengths", ",".join(map(str, LENGTHS)), "--microbatches", "2",
              "--schedule", "1f1b"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *common, "--stages", "2", "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    replans = torch.load(tmp_path / "two.pt")["replans"]
    assert len(replans) == 2 and "input_ids dim 1 is 20 (planned for 12)" in replans[1], replans
    assert_trains_like_one_process(tmp_path / "two.pt", 2, [*common, "--plan", tmp_path / "two.pt.plan.json"],
                                   tmp_path)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_two_processes_train_a_vision_model_on_two_image_sizes_like_one(tmp_path):
    """ResNet-18 under `conveyor launch -n 2` on 48x48, 64x40 and 48x48 images (one capture,
    height and width symbolic): the same losses and weights as one process running the plan."""
    from test_launch import assert_trains_like_one_process, launch
    tool = os.path.join(BUILD, "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    common = ["--case", "resnet18", "--batch", "8", "--images", "48x48,64x40,48x48", "--microbatches", "2",
              "--schedule", "1f1b"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *common, "--stages", "2", "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    assert torch.load(tmp_path / "two.pt")["captures"] == 1
    assert_trains_like_one_process(tmp_path / "two.pt", 2, [*common, "--plan", tmp_path / "two.pt.plan.json"],
                                   tmp_path)


def test_a_model_that_branches_on_its_length_is_captured_once_per_side():
    torch.manual_seed(0)
    net = BranchesOnLength().double()
    case = zoo.ZooCase("branches", net, (torch.randint(0, 32, (8, 12)),), {})
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, microbatches=2, replan="off")
    draws = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, 32, (8, n), generator=draws),), {}) for n in (12, 6, 12, 7, 16)]
    with pytest.warns(UserWarning, match=r"ids dim 1 is 6 \(the capture holds 11 and more\).*2 captures of the model"):
        train_like_eager(case, model, batches, shares=2)
    assert model.capture_count == 2  # lengths 12 and 16 share one, 6 and 7 the other
    print(f"{model.capture_count} captures for lengths 12, 6, 12, 7 and 16")
    # Node lists name one capture's nodes: the other side is refused, naming the size.
    again = conveyor.Module(BranchesOnLength().double(), stages=model.capture.stage_nodes, microbatches=2)
    again(torch.randint(0, 32, (8, 16)))
    with pytest.raises(conveyor.ConveyorValueError, match=r"ids dim 1 is 6 \(the capture holds 11 and more\).*node"):
        again(torch.randint(0, 32, (8, 6)))


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_two_processes_train_a_model_that_branches_on_its_length_like_one(tmp_path):
    """Under `conveyor launch -n 2` the model that branches on its length gets its second
    capture at the same step on both processes; each change of capture builds that
    capture's pipeline again from what the other's stages held (parameters and SGD's
    momentum moving between the processes), and the job trains like one process; state_dict()
    gathers both branches' weights on every process."""
    from test_launch import assert_trains_like_one_process, launch
    tool = os.path.join(BUILD, "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    common = ["--case", "branches", "--batch", "8", "--lengths", "12,6,12,7,16,6", "--microbatches", "2",
              "--stages", "2", "--schedule", "1f1b", "--momentum", "0.9"]
    code, out = launch("-n", 2, "--", sys.executable, WORKER, *common, "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    assert "2 captures of the model now exist" in out, out[-4000:]
    job = torch.load(tmp_path / "two.pt")
    assert job["captures"] == 2
    # state_dict() on process 1 gathers the whole model too, both branches' weights included.
    theirs = torch.load(tmp_path / "two.pt.rank1")["state"]
    assert all(torch.equal(theirs[k], v) for k, v in job["state"].items()), "process 1's state_dict differs"
    assert_trains_like_one_process(tmp_path / "two.pt", 2, common, tmp_path)


class TakesSettings(torch.nn.Module):
    """A model whose call takes non-tensor arguments: a temperature and a flag."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x, y, temperature=1.0, smooth=False):
        logits = self.second(torch.tanh(self.first(x))) / temperature
        return torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1 if smooth else 0.0)


def test_a_call_with_other_non_tensor_arguments_is_captured_again_for_them():
    """The graph holds a call's non-tensor arguments as constants: a call with other values
    takes (or makes) the capture for them, instead of running with the first call's (a
    temperature of 2.0 ran as 0.5 before); a value changing every call is refused after
    MOST_CAPTURES captures, saying to pass it as a tensor."""
    torch.manual_seed(0)
    net = TakesSettings().double()
    draws = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, dtype=torch.float64, generator=draws), torch.randint(0, 3, (8,), generator=draws)
    case = zoo.ZooCase("settings", net, (x, y), {})
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, microbatches=2, replan="off")
    calls = [((x, y), dict(temperature=t, smooth=s)) for t, s in [(0.5, True), (2.0, True), (0.5, True), (0.5, False)]]
    with pytest.warns(UserWarning, match=r"temperature is 2.0 \(captured with 0.5\): the graph holds the model's "
                                         r"non-tensor arguments as constants.*2 captures of the model"):
        train_like_eager(case, model, calls, shares=2)
    assert model.capture_count == 3
    with pytest.raises(conveyor.ConveyorValueError, match=r"temperature is .* captures of the model exist already; "
                                                          r"pass a value that changes from call to call as a tensor"):
        with pytest.warns(UserWarning):
            for k in range(20):
                model.train_step(x, y, temperature=1.0 + k / 10, smooth=True)


def test_a_graph_called_with_other_non_tensor_arguments_refuses_naming_them():
    net = TakesSettings()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    graph = conveyor.capture(net, (x, y), {"temperature": 0.5})
    assert graph(x, y, temperature=0.5).item() == net(x, y, temperature=0.5).item()
    with pytest.raises(conveyor.ConveyorValueError, match=r"temperature is 2.0 \(captured with 0.5\).*capture the "
                                                          r"model again for this value, or pass it as a tensor"):
        graph(x, y, temperature=2.0)
