"""Stages whose replicas split a microbatch differently (replicas [2, 1]): values pass
between them redistributed by sample (graph/batch_values.h), including the sizes and masks
transformers and torch compute once and read in every layer, and training stays exact."""
import copy

import pytest
import torch

import conveyor
import zoo
from conftest import split_batch


@pytest.mark.parametrize("padded", [False, True])
def test_gpt2_cut_between_its_layers_across_replica_counts_trains_like_eager(padded):
    # Transformers builds GPT-2's causal mask by indexing position ids with the batch's
    # arange; each sample's row is its own, so the mask is redistributed between 2 replicas
    # and 1 (graph/batch_values.h). The cut passes it between the two attentions that read it.
    torch.manual_seed(0)
    case = zoo.gpt2(batch=8)
    kwargs = dict(case.kwargs)
    if padded:  # a padding mask too: the mask depends on the data
        tokens = zoo.padded_tokens(8, 16, 96)
        kwargs = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                  "labels": tokens["input_ids"]}
    ref = copy.deepcopy(case.model)
    probe = conveyor.Module(copy.deepcopy(case.model), stages=2, replicas=[1, 1], microbatches=2)
    probe(*case.args, **kwargs)
    nodes = probe.capture.graph.nodes
    attentions = [i for i, n in enumerate(nodes) if n["op"] == "aten::scaled_dot_product_attention"]
    assert len(attentions) == 2, attentions
    cut = attentions[1] - 3
    opt = torch.optim.SGD(case.model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = conveyor.Module(case.model, opt, stages=[list(range(cut)), list(range(cut, len(nodes)))],
                            replicas=[2, 1], microbatches=2)
    for _ in range(2):
        loss = model.train_step(*case.args, **kwargs)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = 0
        for a, k in split_batch(case.args, kwargs, 2, 8):
            part = case.loss(ref(*a, **k)) / 2
            part.backward()
            ref_loss = ref_loss + part.detach()
        ref_opt.step()
        assert abs(loss.item() - ref_loss.item()) <= 1e-9 * abs(ref_loss.item())
    for (n, p), (_, q) in zip(case.model.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= 1e-9, f"{n} differs by {err:.2e}"


def test_a_vit_split_across_replica_counts_is_cut_between_its_layers_and_trains_like_eager():
    # nn.MultiheadAttention reshapes by batch x heads, a size computed once and read by every
    # layer: each share's is its own (graph/batch_values.h), so the planner may cut between
    # layers of stages with 2 replicas and 1 (it kept to the two ends before).
    import torchvision
    torch.manual_seed(0)
    net = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32,
                                               mlp_dim=64, num_classes=10, dropout=0.0).double()
    ref = copy.deepcopy(net)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    model = conveyor.Module(net, opt, loss_fn=torch.nn.CrossEntropyLoss(), stages=2, replicas=[2, 1], microbatches=2)
    for _ in range(2):
        x, y = torch.randn(16, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (16,))
        model.train_step(x, target=y)
        ref_opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            (torch.nn.functional.cross_entropy(ref(xs), ys) / 4).backward()
        ref_opt.step()
    nodes = model.capture.graph.nodes
    ops = [[nodes[i]["op"] for i in stage] for stage in model.capture.stage_nodes]
    assert all("aten::linear" in o for o in ops) and min(len(o) for o in ops) > 30, [len(o) for o in ops]
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
        assert err <= 1e-9, f"{n} differs by {err:.2e}"
