"""conveyor.Module: one line, the automatic plan on this machine, results equal to eager
training with gradient accumulation over the plan's microbatches."""
import copy
import os
import warnings

import pytest
import torch

import conveyor
import zoo

from conftest import split_batch
from launch_worker import NeedsFourSamples  # refuses fewer than four samples at once


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name,batch", [("gpt2", 8), ("resnet18", 8), ("t5", 8), ("bart", 8), ("convnext", 8)])
def test_automatic_plan_trains_like_eager_accumulation(name, batch):
    torch.manual_seed(0)
    case = {**zoo.CASES, **zoo.MORE_CASES}[name](batch=batch)
    ref = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = conveyor.Module(case.model, opt)
    for step in range(3):
        loss = model.train_step(*case.args, **case.kwargs)
        stages, schedule, m, chunks, replicas = model.capture.layout
        # Shares: each microbatch split between the replicas (the same count on every rank
        # when the model has BatchNorm, so that every share sees the same samples).
        shares = replicas[-1]
        assert len(set(replicas)) == 1 or name != "resnet18", replicas
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = 0
        # The reference at each replica's intra-op threads (the caller's shared out): float64
        # kernels round by thread count, and BatchNorm over shares of two samples (4 replicas
        # of a batch of 8 on a machine with many cores) amplifies that past 1e-9.
        saved_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, saved_threads // sum(replicas)))
        for a, k in split_batch(case.args, case.kwargs, m, batch):
            size = next(t.shape[0] for t in list(a) + list(k.values()) if isinstance(t, torch.Tensor) and t.dim() > 0)
            for a2, k2 in split_batch(a, k, shares, size):
                n = next(t.shape[0] for t in list(a2) + list(k2.values())
                         if isinstance(t, torch.Tensor) and t.dim() > 0)
                part = case.loss(ref(*a2, **k2)) * (n / batch)
                part.backward()
                ref_loss = ref_loss + part.detach()
        torch.set_num_threads(saved_threads)
        ref_opt.step()
        assert abs(loss.item() - ref_loss.item()) <= 1e-9 * abs(ref_loss.item()), (step, loss, ref_loss)
    assert model.plan is not None and "predicted step" in str(model.plan)
    assert stages >= 1
    # Live profiles: every step reached the partitioner actor, which compares it with the plan.
    report = model.profile_report()
    assert report.steps == 2  # the first step is warm-up
    assert report.predicted_step_s == pytest.approx(model.plan.predicted_step_s, rel=1e-9)
    assert report.measured_step_s > 0
    assert len(report.stages) == len(model.plan.stage_nodes)
    for s in report.stages:
        assert s["forward_s"] > 0 and s["backward_s"] + s["backward_weight_s"] > 0, s
        assert s["predicted_forward_s"] > 0 and s["compute_ratio"] > 0, s
    assert "measured / predicted" in str(report), str(report)
    for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= 1e-9, f"{name}: {n} differs by {err:.2e} ({model})"
    if max(replicas) == 1:  # with replicas, running statistics follow replica 0 (docs/design.md)
        for (n, b), (_, c) in zip(case.model.named_buffers(), ref.named_buffers()):
            assert torch.equal(b, c) or (b - c).abs().max() <= 1e-9 * max(c.abs().max().item(), 1e-6), n


@pytest.mark.parametrize("schedule,microbatches", [("1f1b", 2), ("zb-h1", 2), ("interleaved", 2), ("zb-v", 2),
                                                   ("dualpipev", 4)])
def test_fixed_stages_with_replicas_train_like_eager_accumulation(schedule, microbatches):
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8)
    ref = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = conveyor.Module(case.model, opt, stages=4, replicas=2, microbatches=microbatches, schedule=schedule)
    shares = 2 * microbatches  # microbatches x 2 replicas
    for _ in range(3):
        loss = model.train_step(*case.args, **case.kwargs)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = 0
        for a, k in split_batch(case.args, case.kwargs, shares, 8):
            part = case.loss(ref(*a, **k)) / shares
            part.backward()
            ref_loss = ref_loss + part.detach()
        ref_opt.step()
        assert abs(loss.item() - ref_loss.item()) <= 1e-9 * abs(ref_loss.item())
    assert "replicas [2, 2" in repr(model), repr(model)
    for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= 1e-9, f"{schedule}: {n} differs by {err:.2e}"
    # The stage count and replicas fixed, the cut planned: the plan has them, with predictions.
    assert len(model.plan.stage_nodes) == 4 and model.plan.schedule == schedule, model.plan.table
    report = model.profile_report()
    assert report.steps == 2 and report.predicted_step_s > 0
    assert [s["replicas"] for s in report.stages] == [2, 2, 2, 2]
    assert all(s["forward_s"] > 0 and s["predicted_forward_s"] > 0 for s in report.stages)
    # Node lists run as given: no plan, so the live profile has measured figures only.
    again = copy.deepcopy(ref)
    given = conveyor.Module(again, torch.optim.SGD(again.parameters(), lr=0.05), stages=model.capture.stage_nodes,
                            replicas=2, microbatches=microbatches, schedule=schedule)
    for _ in range(3):
        given.train_step(*case.args, **case.kwargs)
    report = given.profile_report()
    assert given.plan is None and report.steps == 2 and report.predicted_step_s == 0
    assert all(s["forward_s"] > 0 and s["predicted_forward_s"] == 0 for s in report.stages)
    assert "(measured, ms per microbatch)" in str(report), str(report)


def test_backward_scales_gradients_and_state_stays_the_models():
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    model = conveyor.Module(case.model, stages=2, microbatches=4)
    loss = model(*case.args)
    (loss * 3).backward()
    scaled = {n: p.grad.clone() for n, p in case.model.named_parameters()}
    for p in case.model.parameters():
        p.grad = None
    model(*case.args).backward()
    for n, p in case.model.named_parameters():
        assert torch.allclose(scaled[n], 3 * p.grad, rtol=1e-12, atol=0), n
    assert list(model.state_dict()) == list(case.model.state_dict())
    model.load_state_dict(case.model.state_dict())
    # Without grad: the whole graph, forward only, the same loss as eager.
    with torch.no_grad():
        assert torch.allclose(model(*case.args), case.model(*case.args), rtol=1e-12)


def test_each_call_holds_its_gradients_until_its_loss_backward():
    """Two calls before one backward (accumulating over two batches by hand) sum both
    calls' gradients, each scaled by its loss's incoming gradient; gradients already in
    .grad stay and are added to; a call whose loss never goes backward leaves .grad alone."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    eager = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, stages=2, microbatches=4)
    x, y = case.args
    x2, y2 = torch.randn_like(x), torch.randn_like(y)
    model(x, y)  # never goes backward
    assert all(p.grad is None for p in case.model.parameters())
    for p, q in zip(case.model.parameters(), eager.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    (model(x, y) * 2 + model(x2, y2) * 0.5).backward()
    (eager(x, y) * 2 + eager(x2, y2) * 0.5).backward()
    for (n, p), q in zip(case.model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15), n


def test_train_step_trains_like_eager():
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    eager = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    model = conveyor.Module(case.model, opt, stages=2, microbatches=4)
    for _ in range(3):
        loss = model.train_step(*case.args)
        eager_opt.zero_grad(set_to_none=True)
        want = eager(*case.args)
        want.backward()
        eager_opt.step()
        assert torch.allclose(loss, want.detach(), rtol=1e-12)
    for (n, p), q in zip(case.model.named_parameters(), eager.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-15), n


def test_trace_of_a_real_step_decodes(tmp_path):
    import os
    import subprocess
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8)
    path = tmp_path / "run.pftrace"
    model = conveyor.Module(case.model, stages=3, microbatches=4, schedule="1f1b", trace=path)
    for _ in range(2):
        model(*case.args, **case.kwargs).backward()
    assert path.exists()
    tool = os.path.join(os.environ.get("CONVEYOR_BUILD_DIR", "build"), "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    r = subprocess.run([tool, "trace", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # 3 stages x 4 microbatches: 12 forwards, 12 backwards, 2 x 2 x 4 transfers joined by flows.
    assert "F            12 slices" in r.stdout and "B            12 slices" in r.stdout, r.stdout
    assert "16 flows" in r.stdout, r.stdout
    # The Chrome JSON option: the same slices, a start and a finish per flow.
    import json
    model.write_trace(tmp_path / "run.json")
    events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert sum(e["name"].startswith("F") for e in slices) == 12
    starts = {e["id"] for e in events if e["ph"] == "s"}
    finishes = {e["id"] for e in events if e["ph"] == "f"}
    assert len(starts) == 16 and starts == finishes


def test_trace_of_a_replicated_step_has_a_track_per_replica(tmp_path):
    import os
    import subprocess
    torch.manual_seed(0)
    # An MLP: 2 replicas then 1, a flow per share.
    case = zoo.mlp(batch=8)
    path = tmp_path / "replicated.pftrace"
    model = conveyor.Module(case.model, stages=2, replicas=[2, 1], microbatches=2, trace=path)
    model(*case.args, **case.kwargs).backward()
    tool = os.path.join(os.environ.get("CONVEYOR_BUILD_DIR", "build"), "tools", "conveyor")
    if not os.path.exists(tool):
        pytest.skip(f"conveyor tool not built at {tool}")
    r = subprocess.run([tool, "trace", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # 2 + 1 replicas: an F per replica per microbatch (2 x 2 + 1 x 2); a flow from each
    # stage-0 replica's send into the one stage-1 replica (4), and from each stage-1
    # gradient send into both stage-0 replicas (2 flows, each joining three slices).
    import re
    assert re.search(r"\bF +6 slices", r.stdout) and re.search(r"\bsendA +4 slices", r.stdout), r.stdout
    assert "12 tracks" in r.stdout and "6 flows" in r.stdout, r.stdout


@pytest.mark.parametrize("schedule, stages, m", [("1f1b", 2, 2), ("interleaved", 4, 2), ("dualpipev", 4, 4)])
def test_a_last_batch_too_small_for_the_plan_trains_like_eager(schedule, stages, m):
    """Built for batches of 8 (m microbatches, 2 replicas a stage), the pipeline then gets a
    data loader's last batches of 3 and 1: each runs on the same stages with one replica
    each and as many microbatches as it allows, with eager's loss and gradients (DualPipeV,
    which needs 2 microbatches a stage, as ZB-V: the same placement). Two stages a rank take
    a microbatch count that is a multiple of their 2 ranks: a batch of 1 has none, and the
    plan's pipeline refuses it naming the sizes."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    ref = copy.deepcopy(case.model)
    model = conveyor.Module(case.model, stages=stages, replicas=2, microbatches=m, schedule=schedule)
    for batch in (8, 3, 1):
        x, y = torch.randn(batch, 16, dtype=torch.float64), torch.randn(batch, 4, dtype=torch.float64)
        case.model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if schedule != "1f1b" and batch == 1:
            with pytest.raises(conveyor.ConveyorValueError, match=f"fewer than the {m} microbatches"):
                model(x, y)
            continue
        loss = model(x, y)
        loss.backward()
        want = ref(x, y)
        want.backward()
        assert abs(loss.item() - want.item()) <= 1e-12 * abs(want.item()), batch
        for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
            assert (p.grad - q.grad).abs().max().item() <= 1e-12 * max(q.grad.abs().max().item(), 1e-6), (batch, n)
    assert model.capture.layout[2] == m and model.capture.layout[4] == [2] * (stages // (1 if schedule == "1f1b" else 2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"))])
def test_forwards_run_under_the_callers_autocast_like_eager(device):
    """`with torch.autocast(...)` around the call reaches every stage's forward on the
    replicas' threads (bfloat16 matmuls, as eager's), not their backward; and every step
    casts the weights afresh after the optimizer changed them."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8, dtype=torch.float32)
    case.model.to(device)
    case.args = tuple(a.to(device) for a in case.args)
    ref = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = conveyor.Module(case.model, opt, stages=2, microbatches=2)
    x, y = case.args
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        want = 0
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
            with torch.autocast(device, dtype=torch.bfloat16):
                part = ref(xs, ys) * 0.5
            part.backward()
            want = want + part.detach()
        with torch.no_grad():
            full_precision = ref(x, y)
        assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item()), (step, loss.item(), want.item())
        assert abs(loss.item() - full_precision.item()) > 1e-5 * abs(want.item()), "autocast did not apply"
        for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
            assert p.grad.dtype == torch.float32
            assert (p.grad - q.grad).abs().max().item() <= 1e-5 * max(q.grad.abs().max().item(), 1e-6), (step, n)
        opt.step()
        ref_opt.step()


def test_a_loss_fn_takes_the_calls_target_like_a_criterion():
    """`loss_fn=CrossEntropyLoss()` and `model(x, target=y)`: the target is split into
    microbatches with the input and reaches the criterion, not the model; the result is
    eager's `criterion(net(x), y)` accumulated over the same microbatches."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 5)).double()
    ref = copy.deepcopy(net)
    criterion = torch.nn.CrossEntropyLoss()
    model = conveyor.Module(net, stages=3, microbatches=4, loss_fn=criterion)
    x, y = torch.randn(8, 12, dtype=torch.float64), torch.randint(0, 5, (8,))
    loss = model(x, target=y)
    loss.backward()
    want = sum(criterion(ref(xs), ys) * 0.25 for xs, ys in zip(x.tensor_split(4), y.tensor_split(4)))
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-12 * abs(want.item())
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-12 * max(q.grad.abs().max().item(), 1e-6), n


def test_bad_input_gets_clear_errors():
    torch.manual_seed(0)
    case = zoo.mlp(batch=3)
    with pytest.raises(conveyor.ConveyorValueError, match="smaller than the microbatch count .4.; use at most 3"):
        conveyor.Module(case.model, stages=2, microbatches=4)(*case.args)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    with pytest.raises(conveyor.ConveyorValueError, match="scalar loss"):
        conveyor.Module(net, stages=2)(case.args[0])
    with pytest.raises(conveyor.ConveyorValueError, match="at least one replica"):
        conveyor.Module(case.model, replicas=0)
    with pytest.raises(conveyor.ConveyorValueError, match="unknown schedule"):
        conveyor.Module(case.model, schedule="pipedream")
    with pytest.raises(conveyor.ConveyorValueError, match="2 ranks"):
        conveyor.Module(case.model, stages=2, replicas=[1, 1, 1])(*case.args)
    with pytest.raises(conveyor.ConveyorValueError, match="no step has run yet"):
        conveyor.Module(case.model, stages=2).profile_report()


def test_every_call_checks_its_inputs_against_the_capture_before_running():
    """After the first call built the pipeline, a call whose inputs differ from the capture
    is refused before any work, naming the input and what to pass (the same checks as
    calling the captured graph), and the pipeline goes on training afterwards."""
    torch.manual_seed(0)
    net = NeedsFourSamples().double()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2, microbatches=2)
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    model.train_step(x, y)
    cases = [
        ((x,), "captured with 2 positional arguments; this call passes 1 positional argument"),
        ((x.float(), y), r"input 0 \('x'\) has dtype float32 but the graph was captured with float64"),
        ((x[:, :8], y[:, :8]), r"input 0 \('x'\) has shape \[8, 8\] but the graph was captured for"),
        ((x.unsqueeze(0), y), r"input 0 \('x'\) has shape \[1, 8, 16\]"),
        ((x, y[:4]), "disagree on batch"),
        ((x.to("meta"), y), r"input 0 \('x'\) is on meta but the model is on cpu"),
        ((x, 3.0), r"input 1 \('y'\) is a float, but the model was captured with a tensor there"),
        ((x[:3], y[:3]), "at least 4 samples at once"),  # fewer samples than the model runs at once
    ]
    for args, expected in cases:
        with pytest.raises(conveyor.ConveyorValueError, match=expected):
            model.train_step(*args)
    assert model.train_step(x, y).item() > 0


def test_the_local_cluster_of_a_gpu_model_describes_the_gpu():
    """A CUDA model is planned on its GPU's memory: one process splits the GPU into virtual
    devices that share it; one process per GPU gives each device the whole GPU."""
    import tomllib

    from conveyor.planning.plan_maker import local_cluster

    gpu = 80 << 30
    shared = tomllib.loads(local_cluster(4, 1, gpu_memory=gpu, one_gpu=True))["node"][0]
    assert (shared["devices"], shared["memory"], shared["speed"]) == (4, gpu // 4, 0.25)
    whole = tomllib.loads(local_cluster(2, 1, gpu_memory=gpu, one_gpu=False))["node"][0]
    assert (whole["devices"], whole["memory"], whole["speed"]) == (2, gpu, 1.0)
    cpu = tomllib.loads(local_cluster(2, 1))["node"][0]
    assert cpu["memory"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2  # the CPU's, as before
    # The planner takes them: a model that needs more than a CPU virtual device's share of
    # memory fits a whole GPU.
    case = zoo.CASES["mlp"]()
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    prof = conveyor.profile(graph, case.args, case.kwargs)
    plan = conveyor.plan(graph, prof, local_cluster(2, 1, gpu_memory=gpu, one_gpu=False), batch=16)
    assert plan.stage_nodes and sum(plan.replicas) <= 2  # planned within the two GPUs


def test_random_operators_without_a_generator_are_named_in_a_warning():
    """Dropouts (plain, feature, alpha, in attention) and randint_like draw reproducibly
    from conveyor's seeded generators; an operator that takes no generator (an LSTM's
    dropout between layers) draws from torch's global one, and conveyor says so, naming
    it. An LSTM without dropout draws nothing and is not named."""
    import warnings
    F = torch.nn.functional

    class Noisy(torch.nn.Module):
        def __init__(self, lstm_dropout):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8, dtype=torch.float64)
            self.rnn = torch.nn.LSTM(8, 8, num_layers=2, dropout=lstm_dropout, batch_first=True, dtype=torch.float64)

        def forward(self, x):
            h = F.alpha_dropout(F.dropout(self.fc(x), 0.2), 0.1, True)
            q = F.feature_alpha_dropout(F.dropout2d(h.view(-1, 2, 2, 2), 0.1), 0.1, True).reshape(x.shape[0], 2, 4, 1)
            h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).reshape(h.shape)
            h = h * torch.randint_like(h, 0, 2, dtype=torch.float64)  # h requires grad: its draw does not
            out, _ = self.rnn(h.view(x.shape[0], 1, 8))
            return out.pow(2).mean()

    x = torch.randn(8, 8, dtype=torch.float64)
    for lstm_dropout in (0.0, 0.5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = conveyor.Module(Noisy(lstm_dropout), stages=2, microbatches=2)
            model(x).backward()
        named = [str(w.message) for w in caught if "take no generator" in str(w.message)]
        if lstm_dropout:
            assert len(named) == 1 and "aten::lstm" in named[0], [str(w.message) for w in caught]
        else:
            assert not named, named


class BranchesOnDataWhenEvaluating(torch.nn.Module):
    """A data-dependent branch in eval mode only: train mode captures, eval mode cannot."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 8))

    def forward(self, x, y):
        h = self.body(x)
        if not self.training and h.sum() > 0:
            h = h * 2
        return (h - y).pow(2).mean()


def test_an_eval_mode_that_cannot_be_captured_is_evaluated_whole_saying_why():
    torch.manual_seed(0)
    net = BranchesOnDataWhenEvaluating().double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2)
    model.train_step(x, y)
    statistics = [b.clone() for b in net.buffers()]
    model.eval()
    said = r"(?s)in eval mode cannot be captured, so it is evaluated whole.*if not self.training"
    with pytest.warns(UserWarning, match=said):
        with torch.no_grad():
            got = model(x, y).item()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        with torch.no_grad():
            assert model(x, y).item() == got
    with torch.no_grad():
        assert got == net(x, y).item()
    assert all(torch.equal(a, b) for a, b in zip(statistics, net.buffers())), "evaluation moved BatchNorm's statistics"
    model.train()
    model.train_step(x, y)  # training goes on with its capture


def test_train_step_in_eval_mode_is_refused_before_it_touches_anything():
    """The gradients the caller holds stay, and no eval-mode capture is made for it."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.01), stages=2)
    model.train_step(*case.args)
    grads = [p.grad.clone() for p in case.model.parameters()]
    model.eval()
    with pytest.raises(conveyor.ConveyorValueError, match=r"train_step trains: call model.train\(\) first"):
        model.train_step(*case.args)
    assert all(torch.equal(p.grad, g) for p, g in zip(case.model.parameters(), grads))
    assert model.capture_count == 1


def test_an_evaluation_in_train_mode_leaves_the_steps_memory_peaks_in_the_live_profile():
    """Under no_grad in train mode the training capture's pipeline evaluates (its forwards
    alone): the live profile's measured peaks stay those of the training step."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=16)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.01), stages=2, microbatches=4)
    model.train_step(*case.args)
    before = [row["measured_bytes"] for row in model.profile_report().memory]
    with torch.no_grad():
        model(*case.args)
    after = [row["measured_bytes"] for row in model.profile_report().memory]
    assert before == after and all(b is None or b > 0 for b in before), (before, after)


def test_inference_of_a_model_returning_outputs_gives_eager_s_outputs_whole_saying_so():
    """model.eval() and a call that returns logits (no loss to reduce): the eager model's
    outputs, whole (pipelined evaluation returns a loss), said once; training with loss_fn
    and target goes on pipelined."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 4, (12,))
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2)
    model.eval()
    with pytest.warns(UserWarning, match=r"returns outputs, not a loss, so it is evaluated whole.*1 value: "):
        with torch.no_grad():
            logits = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        with torch.no_grad():
            assert torch.equal(model(x), logits)
    assert torch.equal(logits, net(x))
    with pytest.raises(conveyor.ConveyorValueError, match="must return one scalar loss"):
        model.train()(x)  # training needs a loss


@pytest.mark.parametrize("stages", [None, 2])
def test_plans_keep_shares_within_the_batch_range_the_model_allows(stages):
    torch.manual_seed(0)
    net = NeedsFourSamples()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with torch.no_grad():
        want = net(x, y).item()  # every share's loss is a mean: weighted by size, the batch's
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.01), stages=stages)
    loss = model.train_step(x, y)
    _, _, m, _, replicas = model.capture.layout
    assert 8 // m // max(replicas) >= 4, model.capture.layout
    assert abs(loss.item() - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"))])
@pytest.mark.parametrize("name", ["cnn_batchnorm", "dropout"])
def test_evaluation_in_eval_mode_is_the_eager_model_s_pipelined(name, device):
    """After training, model.eval() and a call under no_grad give eager's eval-mode loss:
    BatchNorm normalizes by its running statistics and leaves them alone, dropout keeps
    everything (the eval mode's own capture), through the pipeline's stages, forwards only,
    gradients untouched. With gradients in eval mode the call trains the eval-mode model
    pipelined (BatchNorm frozen, as in fine-tuning): eager's gradients."""
    torch.manual_seed(0)
    case = zoo.CASES[name]()
    case.model.to(device)
    case.args = tuple(a.to(device) for a in case.args)
    model = conveyor.Module(case.model, torch.optim.SGD(case.model.parameters(), lr=0.05), stages=2, replan="off")
    model.train_step(*case.args, **case.kwargs)
    grads = [p.grad for p in case.model.parameters()]
    ref = copy.deepcopy(case.model).eval()
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        got = [model(*case.args, **case.kwargs).item()]
        want = case.loss(ref(*case.args, **case.kwargs)).item()
    with torch.inference_mode():
        got.append(model(*case.args, **case.kwargs).item())
    tol = 1e-12 if device == "cpu" else 1e-9  # cuDNN's kernels differ with the batch's split
    assert got[0] == got[1] and abs(got[0] - want) <= tol * abs(want), (got, want)
    assert model.plan is not None and len(model.plan.stage_nodes) == 2 and model.capture.graph.modes[0] is False
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by evaluation"
    assert all(p.grad is g for p, g in zip(case.model.parameters(), grads)), "evaluation touched the gradients"
    report = model.profile_report()  # the training capture's: the eval capture has not trained
    assert report.steps == 1 and str(report).startswith("(the training capture's, as it stood after step 1"), report
    case.model.zero_grad(set_to_none=True)
    loss = model(*case.args, **case.kwargs)
    loss.backward()
    case.loss(ref(*case.args, **case.kwargs)).backward()
    for (n, p), q in zip(case.model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= tol * max(q.grad.abs().max(), 1e-3), n
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by an eval-mode step"
    assert model.profile_report().steps == 1 and not str(model.profile_report()).startswith("(")  # its own now
