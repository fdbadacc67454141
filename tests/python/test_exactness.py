"""The captured graph, whole or cut into stages, trains exactly like the eager model.

For every model of the zoo and its more architectures (float64): the loss, every parameter gradient and every buffer
(BatchNorm running statistics) equal eager PyTorch to a relative error of 1e-9, for the
whole graph and for random valid cuts into 2, 3 and 5 stages chained like a pipeline.
"""
import copy

import pytest
import torch

import conveyor
import zoo

TOLERANCE = 1e-9
STAGE_COUNTS = (2, 3, 5)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def restore(model, state):
    with torch.no_grad():
        for k, v in model.state_dict(keep_vars=True).items():
            v.copy_(state[k])  # in place: the graph stays bound to the same tensors
    for p in model.parameters():
        p.grad = None


def compare(model, ref, loss, ref_loss, rel_err, what):
    assert rel_err(loss, ref_loss) <= TOLERANCE, f"{what}: loss {loss.item()} vs {ref_loss.item()}"
    # A gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # shift shared by a row) holds round-off alone, 1e-21 here, whose digits follow the order
    # of the operations: it is judged against a millionth of the model's largest gradient.
    floor = 1e-6 * max((q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None), default=0)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, f"{what}: {name} got a gradient eager did not"
            continue
        assert p.grad is not None, f"{what}: {name} got no gradient"
        err = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), floor, 1e-30)
        assert err <= TOLERANCE, f"{what}: gradient of {name} differs by {err:.3e}"
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, c) or rel_err(b, c) <= TOLERANCE, f"{what}: buffer {name} differs"


@pytest.fixture(scope="module", params=list(zoo.CASES) + list(zoo.MORE_CASES))
def captured(request):
    torch.manual_seed(0)
    case = {**zoo.CASES, **zoo.MORE_CASES}[request.param]()
    initial = snapshot(case.model)
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    restore(case.model, initial)  # capture must not have changed anything, but be sure
    return case, graph, initial


def run_pair(case, initial, call, seed=1234):
    """Runs `call` (graph-based) and the eager model from the same state and RNG seed."""
    ref = copy.deepcopy(case.model)
    restore(case.model, initial)
    restore(ref, initial)
    torch.manual_seed(seed)
    loss = case.loss(call(*case.args, **case.kwargs))
    loss.backward()
    torch.manual_seed(seed)
    ref_loss = case.loss(ref(*case.args, **case.kwargs))
    ref_loss.backward()
    return ref, loss, ref_loss


def test_whole_graph_matches_eager(captured, rel_err):
    case, graph, initial = captured
    ref, loss, ref_loss = run_pair(case, initial, graph)
    compare(case.model, ref, loss, ref_loss, rel_err, f"{case.name} whole graph")


@pytest.mark.parametrize("num_stages", STAGE_COUNTS)
def test_random_stage_cuts_match_eager(captured, num_stages, rel_err):
    case, graph, initial = captured
    # Random draws happen in stage order; cuts that keep the capture order keep eager's
    # RNG order, so models with active dropout are cut along the capture order.
    for seed in range(3):
        staged = graph.split(num_stages, random_cut=True, seed=seed, keep_node_order=not case.deterministic)
        graph.ir.check_partition(staged.partition)
        assert len(staged) == num_stages
        ref, loss, ref_loss = run_pair(case, initial, staged)
        compare(case.model, ref, loss, ref_loss, rel_err, f"{case.name} in {num_stages} stages (seed {seed})")


def test_parameters_are_bound_not_copied(captured):
    case, graph, _ = captured
    live = dict(case.model.named_parameters())
    for name, t in graph.tensors.items():
        if name in live:
            assert t is live[name], f"{name} is a copy"


def test_tied_weights_sum_gradients_across_stages(rel_err):
    torch.manual_seed(0)
    case = zoo.gpt2()
    m = case.model
    assert m.lm_head.weight is m.transformer.wte.weight
    initial = snapshot(m)
    graph = conveyor.capture(m, case.args, case.kwargs)
    names = [b["name"] for b in graph.document["bindings"]]
    tied = [n for n in names if n in ("lm_head.weight", "transformer.wte.weight")]
    assert len(tied) == 1, "a tied weight is bound once"
    binding = next(b for b in graph.document["bindings"] if b["name"] == tied[0])
    assert binding.get("tied") == [n for n in ("lm_head.weight", "transformer.wte.weight") if n != tied[0]]
    # The embedding lookup and the LM head land in different stages.
    readers = [n["id"] for n in graph.nodes for a in n["args"]
               if a.get("value") == next(b["value"] for b in graph.document["bindings"] if b["name"] == tied[0])]
    assert len(readers) == 2
    first, last = min(readers), max(readers)
    partition = [list(range(0, first + 1)), list(range(first + 1, graph.num_nodes))]
    staged = graph.split(partition)
    ref, loss, ref_loss = run_pair(case, initial, staged)
    compare(m, ref, loss, ref_loss, rel_err, "gpt2 with the tied embedding split across stages")
    assert last in staged.partition[1]


def test_batch_size_is_symbolic(rel_err):
    torch.manual_seed(0)
    case = zoo.bert(batch=4)
    graph = conveyor.capture(case.model, case.args, case.kwargs)
    assert graph.dynamic_batch
    assert "batch" in graph.document["symbols"].values()
    for batch in (2, 7):
        ids = torch.randint(0, 96, (batch, 16))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones(batch, 16, dtype=torch.long), "labels": ids}
        out = graph(**kwargs)
        assert out.logits.shape[0] == batch
        assert rel_err(out.loss, case.model(**kwargs).loss) <= TOLERANCE


class BoundedByBatch(torch.nn.Module):
    """Branches on the batch size, as torch's cuDNN BatchNorm does (up to 880801 samples):
    the graph holds only within the bounds the branch checks."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        if 3 <= x.shape[0] <= 1000:
            return (self.fc(x) - y).pow(2).mean()
        return self.fc(x).sum()


def test_a_bounded_batch_stays_symbolic_within_its_bounds_and_shares_outside_are_refused():
    torch.manual_seed(0)
    model = BoundedByBatch()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    graph = conveyor.capture(model, (x, y))
    symbol = next(s for s, role in graph.document["symbols"].items() if role == "batch")
    assert graph.document["ranges"] == {symbol: {"min": 3, "max": 1000}}  # read back from the C++ IR
    partition = graph.random_partition(2, seed=1, keep_node_order=False)

    def step(batch, microbatches):
        xb, yb = torch.randn(batch, 4), torch.randn(batch, 4)
        run = conveyor._C.PipelineStep(graph.executor, partition, "1f1b", microbatches, 1, [1, 1], 0, 1)
        # Eager on each microbatch: the whole batch of 2000 would take the other branch.
        eager = sum(model(a, b) for a, b in zip(xb.tensor_split(microbatches), yb.tensor_split(microbatches)))
        return run.run(graph.flatten_inputs((xb, yb), {}))[0], eager / microbatches

    for batch, m in ((2000, 2), (12, 4)):  # shares of 1000 and 3: inside
        loss, eager = step(batch, m)
        assert abs(loss.item() - eager.item()) <= 1e-5 * abs(eager.item())
    with pytest.raises(conveyor.ConveyorValueError, match="at most 1000 samples.*would run 2000.*more microbatches"):
        step(2000, 1)
    with pytest.raises(conveyor.ConveyorValueError, match="at least 3 samples.*would run 2.*fewer microbatches"):
        step(8, 4)
    # Called whole, the graph checks the same range.
    assert abs(graph(x, y).item() - model(x, y).item()) <= 1e-6 * abs(model(x, y).item())
    for outside in (2, 2000):
        with pytest.raises(conveyor.ConveyorValueError, match=rf"has batch \({symbol}\) = {outside} but the graph "
                                                              rf"holds for 3 to 1000 only"):
            graph(torch.randn(outside, 4), torch.randn(outside, 4))


def test_no_grad_and_multiple_outputs():
    torch.manual_seed(0)

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)

        def forward(self, x):
            return {"left": self.a(x), "right": self.b(x).relu(), "count": (x > 0).sum(dim=1)}

    m = TwoHeads().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    graph = conveyor.capture(m, (x,))
    with torch.no_grad():
        out = graph(x)
    assert set(out) == {"left", "right", "count"}
    assert out["left"].grad_fn is None
    assert torch.equal(out["count"], (x > 0).sum(dim=1))
    staged = graph.split(2, random_cut=True, seed=3)
    out2 = staged(x)
    assert torch.equal(out2["right"], m.b(x).relu())
    (out2["left"].sum() + out2["right"].sum()).backward()
    assert m.a.weight.grad is not None and m.b.weight.grad is not None
