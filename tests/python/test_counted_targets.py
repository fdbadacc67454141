"""A loss averaged over the targets it counts (cross_entropy's ignore_index, class weights)
trains exactly as the whole batch does on one device, however conveyor splits the batch:
padded causal LMs, masked language modelling, a user's loss_fn with class weights, packed
microbatches, and a saved graph (conveyor/counted_targets.py). Each share of a microbatch
counts its own targets, so before the rewrite a share's mean weighed its samples, not its
targets: BERT's masked-LM loss was 4.175327 for eager's 4.172076."""
import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import conveyor
import zoo
from conftest import launch_script
from conveyor import _C
from conveyor.errors import GraphFormatError

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-9  # float64 throughout
LOSS_IN_FLOAT32 = 1e-6  # transformers computes its losses in float32, the models in float64
BATCH, SEQ, VOCAB = 8, 12, 64


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return zoo.gpt2(vocab=VOCAB, seq=SEQ).model


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return zoo.bert(seq=SEQ).model


def _padded(step: int) -> dict:
    """Rows of random lengths; labels -100 past each row's end (and the row lengths differ
    between the microbatches' shares)."""
    return zoo.padded_tokens(BATCH, SEQ, VOCAB, torch.Generator().manual_seed(step))


def _masked(step: int) -> dict:
    """Masked language modelling: about 15% of the tokens are predicted, the rest -100."""
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 96, (BATCH, SEQ), generator=generator)
    chosen = torch.rand(BATCH, SEQ, generator=generator) < 0.15
    chosen[0, 0] = True  # at least one target in the batch
    return {"input_ids": ids.masked_fill(chosen, 0), "attention_mask": torch.ones_like(ids),
            "labels": ids.masked_fill(~chosen, -100)}


def _train_and_compare(net: nn.Module, batches, steps: int = 2, **options) -> conveyor.Module:
    """`steps` SGD steps of conveyor.Module(net, ...) against the eager model on the whole
    batch at once: the losses and the parameters after them agree to LOSS_IN_FLOAT32 (before
    the rewrite, 8e-4 for the loss of BERT's masked LM)."""
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.5), replan="off", verbose=False, **options)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        batch = batches(step)
        loss = model.train_step(**batch).item()
        ref_opt.zero_grad(set_to_none=True)
        want = zoo.loss_of(ref(**batch))
        want.backward()
        ref_opt.step()
        assert abs(loss - want.item()) <= LOSS_IN_FLOAT32 * abs(want.item()), (step, loss, want.item())
    state = model.state_dict()
    for name, want in ref.state_dict().items():
        err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err <= LOSS_IN_FLOAT32, f"{name}: relative error {err:.2e}"
    return model


@pytest.mark.parametrize("layout", [dict(stages=2, microbatches=2, replicas=2, schedule="1f1b"),
                                    dict(stages=1, microbatches=4, replicas=2)])
def test_padded_causal_lm_trains_like_the_whole_batch(layout):
    model = _train_and_compare(_gpt2(), _padded, **layout)
    counted = model.capture.graph.counted_targets
    assert len(counted) == 1 and counted[0]["ignore_index"] == -100


def test_llama_padded_trains_like_the_whole_batch():
    torch.manual_seed(0)
    net = zoo.llama(vocab=VOCAB, seq=SEQ).model
    _train_and_compare(net, _padded, stages=2, microbatches=4, schedule="zb-h1")


def test_masked_language_modelling_trains_like_the_whole_batch():
    _train_and_compare(_bert(), _masked, stages=2, microbatches=4, replicas=2)


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x):
        return self.net(x)


CLASS_WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25], dtype=torch.float64)


def _weighted_loss(out, y):
    return F.cross_entropy(out, y, weight=CLASS_WEIGHTS, ignore_index=4)


def test_class_weights_and_ignore_index_in_a_loss_fn():
    """A loss_fn's mean divides by the weights of the targets it keeps: shares with other
    classes weigh otherwise than their rows."""
    torch.manual_seed(0)
    net = _Classifier().to(torch.float64)
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.5), loss_fn=_weighted_loss, stages=2,
                            microbatches=2, replicas=2, replan="off", verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(16, 6, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 5, (16,), generator=generator)
        y[:6] = 0  # the first microbatch's shares are mostly one light class
        loss = model.train_step(x, target=y).item()
        ref_opt.zero_grad(set_to_none=True)
        want = _weighted_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        assert abs(loss - want.item()) <= TOLERANCE * abs(want.item())
    assert model.capture.graph.counted_targets[0]["weight"] is not None
    for name, want in ref.state_dict().items():
        assert (model.state_dict()[name] - want).abs().max().item() <= TOLERANCE


class _Tagger(nn.Module):
    """Tags each token of a row with one of 5 classes, its loss made one of several ways."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 5)
        self.register_buffer("label_map", torch.tensor([0, 1, 2, 3, 4, -100]))  # 5: ignored
        self.register_buffer("pad_id", torch.tensor(0))
        self.register_buffer("weights32", torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25], dtype=torch.float32))

    def forward(self, ids, tags):
        logits = self.head(torch.tanh(self.embed(ids))).flatten(0, 1)
        if self.how == "label map":  # targets through a table the model holds
            return F.cross_entropy(logits, self.label_map[tags].flatten())
        if self.how == "pad id":  # the padding's id held by the model
            return F.cross_entropy(logits, tags.clamp(max=4).masked_fill(ids == self.pad_id, -100).flatten())
        weights = self.weights32.to(logits.dtype)
        if self.how == "normalized weights":  # class weights computed from the model's own
            weights = weights / weights.sum()
        return F.cross_entropy(logits, tags.clamp(max=4).flatten(), weight=weights, ignore_index=4)


@pytest.mark.parametrize("how", ["label map", "pad id", "converted weights", "normalized weights"])
def test_targets_and_weights_the_model_makes_from_its_buffers(how):
    torch.manual_seed(0)
    net = _Tagger(how).to(torch.float64)
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.5), stages=2, microbatches=2, replicas=2,
                            replan="off", verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        ids, tags = torch.randint(0, 20, (8, 6), generator=generator), torch.randint(0, 6, (8, 6), generator=generator)
        ids[:2], tags[:2] = 0, 5  # the first share counts nothing: eager's mean is over the others
        loss = model.train_step(ids, tags).item()
        ref_opt.zero_grad(set_to_none=True)
        want = ref(ids, tags)
        want.backward()
        ref_opt.step()
        assert abs(loss - want.item()) <= TOLERANCE * abs(want.item()), (how, loss, want.item())
    assert len(model.capture.graph.counted_targets) == 1
    for name, value in ref.state_dict().items():
        assert (model.state_dict()[name] - value).abs().max().item() <= TOLERANCE * max(value.abs().max().item(), 1)


def test_a_counted_mean_added_to_a_mean_over_the_samples_warns():
    """Cross-entropy over counted tokens plus a mean squared error over the samples is neither
    a mean nor a sum: the shares weigh their samples, and the step warns, naming the loss and
    the line that adds the term that keeps it a mean (an MoE's `loss += coef * aux_loss`)."""
    net = _Classifier().to(torch.float64)

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y, ignore_index=4)
        loss += F.mse_loss(out, torch.zeros_like(out))
        return loss

    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=loss_fn, microbatches=2,
                            replan="off", verbose=False)
    first = loss_fn.__code__.co_firstlineno
    with pytest.warns(UserWarning, match=rf"samples \(aten::add_? \(.*test_counted_targets.py:{first + 2}\) adds a "
                                         rf"sum over the samples to a mean over them; so aten::cross_entropy_loss "
                                         rf"\(.*test_counted_targets.py:{first + 1}\), which averages over the "
                                         rf"targets it counts"):
        model.train_step(torch.randn(8, 6, dtype=torch.float64), target=torch.randint(0, 5, (8,)))


def test_packed_microbatches_average_over_all_their_targets():
    """Packed microbatches of different lengths: the step's loss is the mean over every
    counted target of the step, as eager's over the same targets."""
    net = _gpt2()
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.5), stages=2, replan="off", verbose=False)
    long_rows = zoo.padded_tokens(4, SEQ, VOCAB, torch.Generator().manual_seed(1))
    short_rows = zoo.padded_tokens(6, SEQ // 2, VOCAB, torch.Generator().manual_seed(2))
    loss = model.train_step(conveyor.Microbatches([long_rows, short_rows])).item()
    total, counted = 0, 0
    for rows in (long_rows, short_rows):
        logits = ref(**{k: v for k, v in rows.items() if k != "labels"}).logits
        labels = F.pad(rows["labels"], (0, 1), value=-100)[:, 1:]
        total = total + F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        counted += int((labels != -100).sum())
    want = total / counted
    want.backward()
    assert abs(loss - want.item()) <= LOSS_IN_FLOAT32 * abs(want.item())
    state = model.state_dict()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for name, value in ref.state_dict().items():
        assert (state[name] - value).abs().max().item() <= LOSS_IN_FLOAT32 * max(value.abs().max().item(), 1)


def test_a_saved_graph_counts_its_targets(tmp_path):
    net = _bert()
    batch = _masked(0)
    graph = conveyor.capture(net, kwargs=batch)
    graph.save(tmp_path / "bert.cvg")
    loaded = conveyor.Graph.load(str(tmp_path / "bert.cvg"), model=net)
    assert len(graph.counted_targets) == 1 and loaded.counted_targets == graph.counted_targets
    for step in (0, 1):
        batch = _masked(step)
        want = net(**batch).loss.item()
        assert abs(zoo.loss_of(loaded(**batch)).item() - want) <= LOSS_IN_FLOAT32 * abs(want)


def test_a_forged_count_in_a_graph_file_is_refused(tmp_path):
    """A graph file names only its count inputs; what each counts is read from the graph, so
    an entry that does not name the divisor of a counting loss's sum is refused at load."""
    graph = conveyor.capture(_bert(), kwargs=_masked(0))
    doc = graph.document
    count = doc["inputs"][-1]["value"]
    logits = next(n for n in doc["nodes"] if n["op"] == "aten::cross_entropy_loss")["args"][0]["value"]
    aimed_at_logits = json.loads(json.dumps(doc))
    for node in aimed_at_logits["nodes"]:
        if node["op"] == "aten::cross_entropy_loss":
            node["args"][1] = {"value": logits}  # the targets made by the model itself
    for forged, why in (([0], "last 1 inputs"), ([count, count], "last 2 inputs"), (["x"], "list of value ids"),
                        ({"input": count}, "list of value ids"), ([count], "cannot count")):
        bad = dict(aimed_at_logits if why == "cannot count" else doc, extra=dict(doc["extra"], counted_targets=forged))
        path = tmp_path / "forged.cvg"
        _C.save_graph_file(str(path), _C.GraphIR(json.dumps(bad)), [])
        with pytest.raises(GraphFormatError, match=f"counted_targets .*{why}"):
            conveyor.Graph.load(str(path), model=_bert())


def test_a_loss_with_a_term_of_its_own_stays_a_mean():
    """Where the loss also adds a term that is neither a mean nor a sum (a statistic of the
    batch), the counting loss is left a mean and the shares weigh their samples, as
    gradient accumulation does, with the warning that says so."""
    net = _Classifier().to(torch.float64)

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y, ignore_index=4)
        return loss + out.std()

    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 5, (8,))
    graph = conveyor.capture(_LossOf(net, loss_fn), (x, y))
    assert graph.counted_targets == []
    assert any(n["op"] == "aten::cross_entropy_loss" or n["op"].startswith("aten::nll_loss") for n in graph.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=loss_fn, microbatches=2,
                                replan="off", verbose=False)
        first = loss_fn.__code__.co_firstlineno
        with pytest.warns(UserWarning, match=rf"neither a mean nor a sum over the samples \(aten::add "
                                             rf"\(.*test_counted_targets.py:{first + 2}\) adds to it a term that is no "
                                             rf"sum over the samples \(aten::std.*; so aten::cross_entropy_loss "
                                             rf"\(.*:{first + 1}\), which averages over the targets it counts"):
            model.train_step(x, target=y)


class _LossOf(nn.Module):
    def __init__(self, net, loss_fn):
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def forward(self, x, y):
        return self.loss_fn(self.net(x), y)


def train_shares_across_processes() -> None:
    """Run under `conveyor launch -n 2` (this file as a script): each process is fed its own
    half of a padded batch (batches="shares", as a DistributedSampler feeds it), GPT-2 runs
    in 2 stages of 2 replicas, and each step equals eager on the whole batch."""
    torch.manual_seed(0)
    net = _gpt2()
    ref = copy.deepcopy(net)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.5), stages=2, microbatches=2, replicas=2,
                            batches="shares", replan="off", verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        whole = _padded(step)
        mine = {k: v.tensor_split(2)[model.rank] for k, v in whole.items()}
        loss = model.train_step(**mine).item()
        ref_opt.zero_grad(set_to_none=True)
        want = ref(**whole).loss
        want.backward()
        ref_opt.step()
        assert abs(loss - want.item()) <= LOSS_IN_FLOAT32 * abs(want.item()), (step, loss, want.item())
    state = model.state_dict()
    for name, want in ref.state_dict().items():
        assert (state[name] - want).abs().max().item() <= LOSS_IN_FLOAT32 * max(want.abs().max().item(), 1), name
    print(f"process {model.rank}: trained like the whole batch", flush=True)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_each_process_feeding_its_share_trains_like_the_whole_batch():
    code, out = launch_script(__file__)
    assert code == 0, out[-4000:]
    assert out.count("trained like the whole batch") == 2, out[-4000:]


if __name__ == "__main__":
    train_shares_across_processes()
