"""Data-dependent checks captured under guards (conveyor/guards.py): a model that tests a
tensor's values (DETR's `if not torch.isfinite(hidden_states).all():`) is captured with the
branch its example takes and a guard that tests the same tensor on every share of every
step. It trains exactly like eager accumulation; a batch that would take the other branch
stops its step with an error naming the line, leaving the parameters and their gradients
as they were, and the next batch trains on. A branch whose outcome changes from batch to
batch (on a sum compared with a number) is still refused at capture."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

import conveyor
from conftest import split_batch

TOLERANCE = 1e-9


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


class Checked(nn.Module):
    """Two checks of tensor values, as models write them, and a layer."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x, y):
        torch._assert((x.abs() < 1e6).all(), "inputs out of range")
        h = self.layer(x)
        if not torch.isfinite(h).all():
            h = torch.nan_to_num(h)
        return (h - y).pow(2).mean()


class BranchesOnASum(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        h = self.layer(x)
        if h.sum() > 0:
            h = -h
        return h.pow(2).mean()


def test_checks_of_tensor_values_are_captured_under_guards_naming_their_lines():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.warns(UserWarning, match=r"Checked checks tensor values; captured with the branch the example takes, "
                                         r"under a guard .*test_guards.py:\d+ \(`torch._assert\(.*"
                                         r"test_guards.py:\d+ \(`if not torch.isfinite\(h\).all\(\):`\), True"):
        graph = conveyor.capture(Checked(), (x, y))
    guards = [n for n in graph.document["nodes"] if n["op"] == "conveyor::guard"]
    assert len(guards) == 2, [n["op"] for n in graph.document["nodes"]]
    assert graph.dynamic_batch


def test_a_failed_assertion_stops_the_step_as_a_guard_naming_its_line():
    """torch._assert on a tensor: a guard under torch 2.11, which refuses the branch, and
    under torch 2.15, which captures the assertion itself (aten._assert_async) alike."""
    net = Checked()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), microbatches=2, replan="off",
                            verbose=False)
    model.train_step(torch.randn(6, 4), torch.randn(6, 4))
    x = torch.randn(6, 4)
    x[5, 0] = 1e7
    before = [p.clone() for p in net.parameters()]
    with pytest.raises(conveyor.ExecutionError, match=r"GuardError: conveyor: a guard stopped the step, before any "
                                                      r"parameter was updated: .*test_guards.py:\d+ \(`torch._assert"):
        model.train_step(x, torch.randn(6, 4))
    assert all(torch.equal(p, q) for p, q in zip(before, net.parameters()))


def test_guards_off_refuses_a_check_as_any_branch_on_a_value():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.raises(conveyor.CaptureError, match=r"test_guards.py:\d+"):
        conveyor.capture(Checked(), (x, y), guards=False)
    net = Checked()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), guards=False, verbose=False)
    with pytest.raises(conveyor.CaptureError, match=r"test_guards.py:\d+"):
        model.train_step(x, y)


def test_a_branch_on_a_sum_is_still_refused_naming_its_line():
    with pytest.raises(conveyor.CaptureError, match=r"(?s)test_guards.py:\d+: if h.sum\(\) > 0.*data-dependent"):
        conveyor.capture(BranchesOnASum(), (torch.randn(6, 4),))


class CheckedFixedBatch(nn.Module):
    """A check, and a reshape that ties the batch to 6: the capture tries a symbolic batch,
    then fixed sizes, and each attempt must meet the check."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x, y):
        h = torch.tanh(self.layer(x))
        if not torch.isfinite(h).all():
            h = torch.nan_to_num(h)
        return (h.reshape(6, 4) - y).pow(2).mean()


def test_a_check_is_guarded_in_every_attempt_of_a_capture_that_retries():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.warns(UserWarning) as said:
        graph = conveyor.capture(CheckedFixedBatch(), (x, y))
    said = [str(w.message) for w in said]
    assert any("specializes its batch size" in text for text in said), said
    assert any(re.search(r"under a guard .*test_guards.py:\d+ \(`if not torch.isfinite\(h\).all\(\):`\), True", text)
               for text in said), said
    assert not graph.dynamic_batch
    assert sum(n["op"] == "conveyor::guard" for n in graph.document["nodes"]) == 1


class BranchesOnAFilteredSize(nn.Module):
    """A branch on how many values a filter keeps, as torchvision's box utilities have it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        h = self.layer(x)
        kept = h[h > 0]
        if kept.numel() == 0:
            return h.sum() * 0
        return kept.pow(2).mean()


def test_a_branch_on_a_size_values_decide_is_refused_naming_its_line_and_what_to_change():
    with pytest.raises(conveyor.CaptureError, match=r"(?s)test_guards.py:\d+: if kept.numel\(\) == 0:.*a size that "
                                                    r"tensor values decide.*keep that size fixed"):
        conveyor.capture(BranchesOnAFilteredSize(), (torch.randn(6, 4),))


class DetrSetLoss(nn.Module):
    """transformers' DETR (DetrModel, training mode), its queries' boxes scored against the
    target boxes as a set: each target's nearest prediction, whatever the queries' order."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
                                             out_features=["stage4"])
        config = transformers.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                                         backbone_config=backbone, d_model=16, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                         decoder_ffn_dim=16, num_queries=5, dropout=0.0, attention_dropout=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.detr = transformers.DetrModel(config)
        self.boxes = nn.Linear(16, 4)

    def forward(self, pixel_values, boxes):
        predicted = self.boxes(self.detr(pixel_values=pixel_values).last_hidden_state).sigmoid()
        distance = (predicted[:, None] - boxes[:, :, None]).pow(2).sum(-1)
        return distance.min(-1).values.mean()


def test_detr_trains_exactly_under_guards_and_a_batch_that_fails_a_check_stops_its_step():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        net = DetrSetLoss().train()
        ref = copy.deepcopy(net)
        opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        model = conveyor.Module(net, opt, stages=2, microbatches=2, replicas=2, replan="off", verbose=False)

        def batch(seed):
            generator = torch.Generator().manual_seed(seed)
            return torch.randn(4, 3, 32, 32, generator=generator), torch.rand(4, 3, 4, generator=generator)

        def step_both(pixels, boxes):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = model.train_step(pixels, boxes).item()
            ref_opt.zero_grad(set_to_none=True)
            want = 0
            for args, _ in split_batch((pixels, boxes), {}, 4, 4):  # 2 microbatches x 2 replicas
                part = ref(*args) * 0.25
                part.backward()
                want = want + part.item()
            ref_opt.step()
            assert abs(loss - want) <= TOLERANCE * abs(want), (loss, want)

        step_both(*batch(0))
        assert sum(n["op"] == "conveyor::guard" for n in model.capture.graph.document["nodes"]) == 1
        pixels, boxes = batch(1)
        pixels[3, 0, 0, 0] = float("inf")  # the last share's encoder output is not finite
        before = {name: t.clone() for name, t in net.state_dict().items()}
        opt.zero_grad(set_to_none=True)
        said = (r"GuardError: conveyor: a guard stopped the step, before any parameter was updated: "
                r".*modeling_detr.py:\d+ \(`if not torch.isfinite\(hidden_states\).all\(\):`\) tested a tensor that "
                r"was True when the model was captured and is False")
        with pytest.raises(conveyor.ExecutionError, match=said):
            model(pixels, boxes)  # the step's gradients are held for loss.backward(), which never comes
        assert all(p.grad is None for p in net.parameters())
        with pytest.raises(conveyor.ExecutionError, match=said):
            model.train_step(pixels, boxes)  # its gradients go to .grad as they come; the next step zeroes them
        assert all(torch.equal(t, net.state_dict()[name]) for name, t in before.items())
        step_both(*batch(2))
        for name, want in ref.state_dict().items():
            err = (net.state_dict()[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    finally:
        torch.set_default_dtype(torch.float32)
