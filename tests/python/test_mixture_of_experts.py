"""Mixtures of experts split into microbatches and replicas and train exactly like eager
gradient accumulation over the same shares, their load-balancing loss included (each share
computes it, as accumulation does), in one process and across two: Mixtral, Qwen3-MoE and
Qwen2-MoE (shared experts), and PhiMoE (keys from max()) in transformers' default experts implementation, which sorts the tokens by expert, counts them
per expert, multiplies each group by its expert and puts the tokens back. The batch analysis
proves such routing keeps every token to itself (conveyor/row_order.py); a model whose rows
do depend on each other, capacity-limited routing above all, is still refused, naming the
operator."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import conveyor
import zoo
from conftest import launch_script, split_batch
from conveyor import _C
from conveyor.call_splitting import where_samples_mix

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

TOLERANCE = 1e-9
TORCH_GROUPED_MM = moe._can_use_grouped_mm  # transformers' own choice, before float64_experts
BATCH, SEQ, VOCAB = 8, 6, 64


def assert_two_stages_of_two_replicas_like_accumulation(net, x, y) -> None:
    """One step of `net(x, y)` (its loss) on 2 stages x 2 microbatches x 2 replicas gives the
    loss and gradients of eager accumulation over the same 4 shares."""
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2, microbatches=2, replicas=2,
                            replan="off", verbose=False)
    loss = model(x, y)
    loss.backward()
    want = sum(ref(a, b) * 0.25 for a, b in zip(x.tensor_split(4), y.tensor_split(4)))
    want.backward()
    assert abs(loss.item() - want.item()) <= TOLERANCE * abs(want.item())
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        err = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), 1e-30)
        assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def float64_experts(monkeypatch):
    """torch's grouped_mm has no float64 kernel on the CPU: eager takes transformers' own
    fallback (one matrix product per expert), as the capture does under torch.export."""
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args, **kwargs: False)


def _common(**more):
    return dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1, use_cache=False,
                **more)


FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_common(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_common(intermediate_size=24, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, head_dim=8))),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_common(intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4,
                  num_experts_per_tok=2))),
}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAMILIES[family]().to(torch.float64)


def _tokens(family: str, seed: int) -> dict:
    """Mixtral's batches are full; the Qwens' are padded (an attention mask, which their
    load-balancing loss weighs the tokens by)."""
    generator = torch.Generator().manual_seed(seed)
    if family != "mixtral":
        return zoo.padded_tokens(BATCH, SEQ, VOCAB, generator)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def _train_and_compare(net: nn.Module, family: str, microbatches: int, replicas: int,
                       **options) -> conveyor.Module:
    """Two SGD steps of conveyor.Module(net, ...) against eager gradient accumulation over the
    same shares (each microbatch split between the replicas, weighed by its part of the batch)."""
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), microbatches=microbatches,
                            replicas=replicas, replan="off", verbose=False, **options)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        batch = _tokens(family, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the load-balancing loss is neither a mean nor a sum: said once
            loss = model.train_step(**batch).item()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = 0  # a float32 tensor: transformers computes its losses in float32
        for _, micro in split_batch((), batch, microbatches, BATCH):
            for _, share in split_batch((), micro, replicas, micro["input_ids"].shape[0]):
                part = ref(**share).loss * (share["input_ids"].shape[0] / BATCH)
                part.backward()
                ref_loss = ref_loss + part.detach()
        ref_opt.step()
        assert abs(loss - ref_loss.item()) <= TOLERANCE * abs(ref_loss.item()), (step, loss, ref_loss.item())
    state = model.state_dict()  # across processes too
    for name, want in ref.state_dict().items():
        err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    return model


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_models_train_like_eager_accumulation(family, schedule):
    net = _model(family)
    assert net.config._experts_implementation == "grouped_mm"  # transformers' default
    model = _train_and_compare(net, family, microbatches=2, replicas=2, stages=2, schedule=schedule)
    assert model.capture.layout.microbatches == 2 and model.capture.layout.replicas == [2, 2]


@pytest.mark.parametrize("schedule, stage_count", [("1f1b", 2), ("zb-h1", 3)])
def test_cuts_inside_moe_layers_train_like_eager_accumulation(schedule, stage_count):
    """Each stage but the last ends between the two expert products of an MoE layer: the
    tokens in expert order, their counts and the order itself cross to the next stage."""
    net = _model("mixtral")
    spare = copy.deepcopy(net)
    planned = conveyor.Module(spare, torch.optim.SGD(spare.parameters(), lr=0.1), stages=2, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned.train_step(**_tokens("mixtral", 0))
    graph = planned.capture.graph
    products = [n["id"] for n in graph.document["nodes"] if n["op"] == "transformers::grouped_mm_fallback"]
    cuts = products[0:2 * (stage_count - 1):2]  # the first product of layer 0, then of layer 1
    nodes = [n["id"] for n in graph.document["nodes"]]
    bounds = [-1] + cuts + [max(nodes)]
    stages = [[n for n in nodes if low < n <= high] for low, high in zip(bounds, bounds[1:])]
    _train_and_compare(net, "mixtral", microbatches=2, replicas=2, stages=stages, schedule=schedule)


def test_phimoe_whose_keys_come_from_max_trains_like_eager_accumulation():
    """PhiMoE's router picks each token's experts with max() (sparsemixer), twice, and
    concatenates them: keys within [0, experts - 1], so histc counts every one. Its routers
    run in eval mode here: in training they draw a Gumbel sample, which conveyor's seeded
    generators draw otherwise than eager does."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **_common(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))).to(torch.float64)
    routers = [m for m in net.modules() if type(m).__name__ == "PhimoeTopKRouter"]
    assert routers
    for router in routers:
        router.eval()
    model = _train_and_compare(net, "mixtral", microbatches=2, replicas=2, stages=2, schedule="1f1b")
    assert model.capture.layout.microbatches == 2 and model.capture.layout.replicas == [2, 2]
    assert "aten::histc" in {n["op"] for n in model.capture.graph.document["nodes"]}


def train_across_processes() -> None:
    """Run under `conveyor launch -n 2` (this file as a script): Mixtral in 2 stages of 2
    replicas over the two processes trains 2 steps like eager accumulation."""
    warnings.simplefilter("ignore")
    moe._can_use_grouped_mm = lambda *args, **kwargs: False  # as float64_experts does
    model = _train_and_compare(_model("mixtral"), "mixtral", microbatches=2, replicas=2, stages=2, schedule="zb-h1")
    print(f"process {model.rank}: trained like eager accumulation ({model.capture.layout})", flush=True)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_an_moe_model_trains_like_eager_accumulation_across_processes():
    code, out = launch_script(__file__)
    assert code == 0, out[-4000:]
    assert out.count("trained like eager accumulation") == 2, out[-4000:]


def test_moe_in_bfloat16_runs_torchs_grouped_mm_and_is_split(monkeypatch):
    """In bfloat16 transformers calls torch's grouped_mm (aten::_grouped_mm) rather than its
    fallback: the analysis knows both. The loss equals eager accumulation's."""
    monkeypatch.setattr(moe, "_can_use_grouped_mm", TORCH_GROUPED_MM)
    net = _model("mixtral").to(torch.bfloat16)
    ref = copy.deepcopy(net)
    batch = _tokens("mixtral", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = conveyor.capture(net, (), batch)
        assert "aten::_grouped_mm" in {n["op"] for n in graph.document["nodes"]}
        assert where_samples_mix(graph.document) is None
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2, microbatches=2,
                                replan="off", verbose=False)
        loss = model(**batch).item()
    want = sum(ref(**share).loss.item() / 2 for _, share in split_batch((), batch, 2, BATCH))
    assert abs(loss - want) <= 1e-6 * abs(want), (loss, want)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_transformers_eager_experts_train_like_eager_accumulation(family):
    """The eager experts loop over the experts a batch routes to (from a nonzero), which no
    graph holds: capture traces them through transformers' grouped implementation, the same
    products (moe_experts.py), and the model keeps its own setting. The reference runs the
    eager loop itself."""
    net = _model(family)
    net.set_experts_implementation("eager")
    assert net.config._experts_implementation == "eager"
    model = _train_and_compare(net, family, microbatches=2, replicas=2, stages=2, schedule="1f1b")
    assert net.config._experts_implementation == "eager"
    assert "transformers::grouped_mm_fallback" in {n["op"] for n in model.capture.graph.document["nodes"]}


class RoutedExperts(nn.Module):
    """Tokens routed to 2 of 4 experts as transformers' grouped_mm experts route them (sort the
    (token, expert) pairs by expert, count them per expert, one product per expert, put them
    back), then a classifier; `routing` names what it does otherwise."""

    def __init__(self, routing: str = "exact"):
        super().__init__()
        self.routing = routing
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        rows = x.reshape(-1, 8)
        if self.routing == "tokens normalized over the batch":
            rows = rows - rows.mean(0)
        weights, experts = torch.topk(self.router(rows).softmax(-1), 2, dim=-1)
        keys, order = torch.sort(experts.reshape(-1), descending=self.routing == "sorted descending")
        pairs = rows[order // 2]
        if self.routing == "pairs not sorted":
            pairs = rows.repeat_interleave(2, dim=0)
        if self.routing == "pairs from other tokens":
            pairs = rows[order // 3]
        counts = torch.histc(keys.to(x.dtype), bins=4, min=0, max=2 if self.routing == "narrow counts" else 3)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        if self.routing == "counts for offsets":
            offsets = counts.to(torch.int32)
        if self.routing == "offsets not counted":
            offsets = torch.arange(1, 5, dtype=torch.int32) * (keys.shape[0] // 4)
        scale = weights.reshape(-1)[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0])
        if self.routing == "capacity by counts":  # a pair past the first 3 of its expert is dropped
            first_of_expert = (offsets - counts.to(torch.int32))[keys]
            scale = scale * (torch.arange(keys.shape[0]) - first_of_expert < 3).to(x.dtype)
        if self.routing == "capacity by rank":  # pairs past the first 12 in expert order are dropped
            scale = scale * (inverse < 12).to(x.dtype)[order]
        out = torch.ops.transformers.grouped_mm_fallback(pairs, self.experts, offsets) * scale[:, None]
        if self.routing != "kept in expert order":
            out = out[inverse]
        return F.cross_entropy(self.head(out.view(-1, 2, 8).sum(1)), y.reshape(-1))


def _graph_of(routing: str):
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return conveyor.capture(RoutedExperts(routing), (x, y)), x, y


def test_routing_that_keeps_tokens_apart_is_split_exactly():
    torch.set_default_dtype(torch.float64)
    try:
        graph, x, y = _graph_of("exact")
        assert where_samples_mix(graph.document) is None
        torch.manual_seed(0)
        net = RoutedExperts()
        assert_two_stages_of_two_replicas_like_accumulation(net, x, y)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("routing, named", [
    ("capacity by counts", r"aten::sub \(.*uses the counts of aten::histc .* otherwise than as the offsets"),
    ("capacity by rank", r"aten::lt \(.*reads the places aten::sort .* gives the rows as data"),
    ("kept in expert order", r"combines rows in the order aten::sort .* gave them with rows in another order"),
    ("pairs not sorted", r"grouped_mm_fallback \(.*groups rows that are not sorted by the keys its offsets count"),
    ("pairs from other tokens", r"aten::index \(.*reads the places aten::sort .* gives the rows as data"),
    ("sorted descending", r"aten::index \(.*combines rows in the order aten::sort .* with rows in another order"),
    ("counts for offsets", r"grouped_mm_fallback \(.*takes the counts of aten::histc .* not their running sum"),
    ("offsets not counted", r"grouped_mm_fallback \(.*groups rows by offsets that do not count their sorted keys"),
    ("narrow counts", r"aten::histc \(.*counts keys sorted by aten::sort .* that may fall outside its range"),
    ("tokens normalized over the batch", r"aten::mean \(.*leaves no batch dimension"),
])
def test_routing_whose_tokens_depend_on_each_other_is_refused_naming_the_operator(routing, named):
    graph, x, y = _graph_of(routing)
    found = where_samples_mix(graph.document)
    assert found is not None and "test_mixture_of_experts.py" in found, found
    assert re.search(named, found), found
    net = RoutedExperts(routing)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), microbatches=2, verbose=False)
    with pytest.raises(conveyor.ConveyorValueError, match="microbatches=2 would split each call along dim 0"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x, y)


class SplitExperts(nn.Module):
    """Tokens routed to 2 of 4 experts as JetMoE routes them: a one-hot of each token's experts
    summed over the tokens counts the pairs per expert, the pairs sorted by expert are split
    by those counts, each group multiplied by its expert, joined, and added back to their
    tokens; `routing` names what it does otherwise."""

    def __init__(self, routing: str = "exact"):
        super().__init__()
        self.routing = routing
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        rows = x.reshape(-1, 8)
        weights, experts = torch.topk(self.router(rows).softmax(-1), 2, dim=-1)
        one_hot = torch.zeros(rows.shape[0], 4, dtype=x.dtype).scatter(1, experts, 1)
        if self.routing == "a count cleared in place":
            one_hot[:, 0] = 0
        counts = one_hot.long().sum(0).tolist()
        _, order = experts.flatten().sort(0)
        token = order.div(2, rounding_mode="trunc")
        groups = rows[token].split(counts, dim=0)
        if self.routing == "groups joined out of order":
            groups = groups[::-1]
        out = [group @ self.experts[e] for e, group in enumerate(groups)]
        if self.routing == "a group centred":
            out = [o - o.mean(0) for o in out]
        if self.routing == "capacity by place in the group":  # a pair past the first 3 of its expert is dropped
            out = [o * (torch.arange(o.shape[0]) < 3).to(x.dtype)[:, None] for o in out]
        if self.routing == "a group sorted":
            out = [o.sort(0).values for o in out]
        if self.routing == "scaled by the count":
            out = [o / (1 + count) for o, count in zip(out, counts)]
        out = torch.cat(out, 0) * weights.flatten()[order][:, None]
        return F.cross_entropy(self.head(torch.zeros_like(rows).index_add(0, token, out)), y.reshape(-1))


def test_rows_split_by_their_counts_train_exactly_and_jetmoe_too():
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4, 5))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert where_samples_mix(conveyor.capture(SplitExperts(), (x, y)).document) is None
        net = SplitExperts()
        assert_two_stages_of_two_replicas_like_accumulation(net, x, y)
    finally:
        torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jetmoe = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
            **_common(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))).to(torch.float64)
    model = _train_and_compare(jetmoe, "mixtral", microbatches=2, replicas=2, stages=2, schedule="1f1b")
    assert model.capture.layout.microbatches == 2 and model.capture.layout.replicas == [2, 2]


@pytest.mark.parametrize("routing, named", [
    ("groups joined out of order", r"aten::cat \(.*joins groups of the rows of aten::split_with_sizes"),
    ("a group centred", r"aten::mean \(.*leaves no batch dimension"),
    ("capacity by place in the group", r"aten::arange \(.*uses the counts of keys as data"),
    ("scaled by the count", r"uses the counts of keys as data"),
    ("a group sorted", r"aten::sort \(.*sorts rows already in the order aten::sort"),
    ("a count cleared in place", r"writes in place into the keys, places or counts of a sort"),
])
def test_rows_split_by_their_counts_that_meet_are_refused_naming_the_operator(routing, named):
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = where_samples_mix(conveyor.capture(SplitExperts(routing), (x, y)).document)
    assert found is not None and "test_mixture_of_experts.py" in found and re.search(named, found), found


if __name__ == "__main__":
    train_across_processes()
