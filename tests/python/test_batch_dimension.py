"""conveyor.Module splits each call along dim 0 of its inputs. Where that is not the batch
(a time-major model: nn.Transformer's default layout, an LSTM without batch_first) or the
capture fixed the batch size (an input flattened to batch x length rows), a call runs whole,
in one microbatch on one replica per stage, and trains exactly like eager PyTorch on the
whole batch; splitting it anyway is refused, naming why. The graph check that finds such
models leaves the zoo's models alone. A split step weighs each share's loss by how the loss
combines the samples: a summed loss trains like the whole batch as an averaged one does,
and one that is neither warns, naming the operator."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import conveyor
from conftest import launch_script
import zoo
from conveyor import _C
from conveyor.errors import ConveyorValueError
from conveyor.loss_wrapper import loss_wrapper
from conveyor.call_splitting import where_samples_mix

TOLERANCE = 1e-9


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))


class TimeMajorEncoder(torch.nn.Module):
    """nn.TransformerEncoder in its default layout: x is [sequence, batch, features]."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(0))


class TimeMajorLSTM(torch.nn.Module):
    """PyTorch's word-language-model layout: tokens [sequence, batch], one logit row per token."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 16, num_layers=2)
        self.decoder = torch.nn.Linear(16, 50)

    def forward(self, tokens):
        return self.decoder(self.lstm(self.embedding(tokens))[0]).view(-1, 50)


class FlatTargetLSTM(torch.nn.Module):
    """Batch first, but the loss pairs each token's logits with a target flattened to
    batch x length rows: torch.export ties the target's rows to 8 * batch."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 16, batch_first=True)
        self.decoder = torch.nn.Linear(16, 50)

    def forward(self, tokens):
        return self.decoder(self.lstm(self.embedding(tokens))[0]).flatten(0, 1)


def time_major_encoder():
    return TimeMajorEncoder(), torch.randn(8, 6, 16), torch.tensor([0, 1, 2, 0, 1, 2])


def time_major_lstm():
    tokens = torch.randint(0, 50, (8, 6))
    return TimeMajorLSTM(), tokens, torch.randint(0, 50, (8 * 6,))


def flat_target_lstm():
    tokens = torch.randint(0, 50, (6, 8))
    return FlatTargetLSTM(), tokens, tokens.flatten()


@pytest.mark.parametrize("make, warned", [
    (time_major_encoder, "combines values across dim 0 of its inputs, which splitting would cut: "
                         "aten::scaled_dot_product_attention"),
    (time_major_lstm, "TimeMajorLSTM specializes its batch size"),  # export fixes an LSTM's length
    (flat_target_lstm, "specializes its batch size (target dim 0 must be 8*batch)"),
])
def test_a_call_that_cannot_be_split_runs_whole_and_trains_like_eager(make, warned):
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        net, x, y = make()
        ref = copy.deepcopy(net)
        loss_fn = torch.nn.CrossEntropyLoss()
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), loss_fn=loss_fn, stages=2)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [model.train_step(x, target=y).item() for _ in range(2)]
        assert any(warned in str(w.message) for w in caught), [str(w.message) for w in caught]
        _, _, microbatches, _, replicas = model.capture.layout
        assert microbatches == 1 and max(replicas) == 1, model.capture.layout
        for step in range(2):
            ref_opt.zero_grad()
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            assert losses[step] == pytest.approx(ref_loss.item(), rel=TOLERANCE, abs=0), step
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
            assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    finally:
        torch.set_default_dtype(torch.float32)


def train_whole_across_processes() -> None:
    """Run under `conveyor launch -n 2` (this file as a script): both kinds of call that
    cannot be split train 2 steps like eager, with the stages in two processes."""
    warnings.simplefilter("ignore")
    torch.set_default_dtype(torch.float64)
    for make in (time_major_encoder, flat_target_lstm):
        torch.manual_seed(0)
        net, x, y = make()
        ref = copy.deepcopy(net)
        loss_fn = torch.nn.CrossEntropyLoss()
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), loss_fn=loss_fn, stages=2)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for step in range(2):
            loss = model.train_step(x, target=y).item()
            ref_opt.zero_grad()
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            assert abs(loss - ref_loss.item()) <= TOLERANCE * abs(ref_loss.item()), (make.__name__, step)
        state = model.state_dict()
        for name, want in ref.state_dict().items():
            err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            assert err <= TOLERANCE, f"{make.__name__}: {name} relative error {err:.2e}"
        print(f"process {model.rank}: {make.__name__} ran whole and trained like eager", flush=True)


@pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")
def test_calls_that_cannot_be_split_train_like_eager_across_processes():
    code, out = launch_script(__file__)
    assert code == 0, out[-4000:]
    assert out.count("ran whole and trained like eager") == 4, out[-4000:]


@pytest.mark.parametrize("asked", [{"microbatches": 2}, {"replicas": 2}])
def test_splitting_a_call_that_cannot_be_split_is_refused_naming_why(asked):
    net, x, y = time_major_encoder()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), loss_fn=torch.nn.CrossEntropyLoss(),
                            **asked)
    key, value = next(iter(asked.items()))
    with pytest.raises(ConveyorValueError, match=f"{key}={value} would split each call along dim 0 of its inputs, "
                                                 "but TimeMajorEncoder combines values across dim 0"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.train_step(x, target=y)


class BatchFirstGRU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.gru(x)[0][:, -1]), y)


class MeanOverBatchFirst(torch.nn.Module):
    """A loss that averages over the batch before summing the features: still a sum of samples."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return (self.linear(x) - y).pow(2).mean(0).sum()


@pytest.mark.parametrize("name", ["gpt2", "t5", "resnet18", "cnn_batchnorm", "unet3d", "gru", "mean_over_batch"])
def test_models_whose_dim_0_is_the_batch_are_split(name):
    torch.manual_seed(0)
    if name == "gru":
        model, args, kwargs = BatchFirstGRU(), (torch.randn(4, 8, 16), torch.tensor([0, 1, 2, 0])), {}
    elif name == "mean_over_batch":
        model, args, kwargs = MeanOverBatchFirst(), (torch.randn(4, 16), torch.randn(4, 3)), {}
    else:
        case = zoo.CASES[name](dtype=torch.float32)
        model, args, kwargs = loss_wrapper(case.model, None, case.args, case.kwargs), case.args, case.kwargs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = conveyor.capture(model, args, kwargs)
    assert graph.dynamic_batch
    assert where_samples_mix(graph.document) is None


class TimeMajor(torch.nn.Module):
    """x is [sequence, batch, features]; `mix` says how the sequence is combined."""

    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        if self.mix == "attention by hand":
            xb = x.transpose(0, 1)  # [batch, sequence, features]
            weights = torch.softmax(xb @ xb.transpose(1, 2) * 0.25, dim=-1)
            h = (weights @ xb)[:, -1]
        elif self.mix == "convolution":
            h = self.conv(x.permute(1, 2, 0))[..., -1]
        elif self.mix == "cumulative sum":
            h = x.cumsum(0)[-1]
        else:  # mean pooling over the sequence
            h = torch.tanh(x).mean(0)
        return torch.nn.functional.cross_entropy(self.head(h), y)


@pytest.mark.parametrize("mix, named", [
    ("attention by hand", "aten::matmul"), ("convolution", "aten::conv1d"), ("cumulative sum", "aten::cumsum"),
    ("mean pooling", "aten::mean"),
])
def test_a_time_major_model_is_found_naming_the_operator(mix, named):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = conveyor.capture(TimeMajor(mix), (torch.randn(8, 4, 16), torch.tensor([0, 1, 2, 0])))
    found = where_samples_mix(graph.document)
    assert found is not None and found.startswith(named), found
    assert "test_batch_dimension.py" in found, found  # the user's source line


class RowsMeet(torch.nn.Module):
    """Rows of a batch-first model that meet one another: `how` says how."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.head, self.table = how, torch.nn.Linear(16, 3), torch.nn.Embedding(64, 16)

    def forward(self, x, y):
        h = torch.tanh(x)
        rows = h.shape[0]
        if self.how == "rows past a capacity dropped by their place":
            h = h * (torch.arange(rows) < 6).to(h.dtype)[:, None]
        elif self.how == "each row's place looked up in a table":
            h = h + self.table(torch.arange(rows))
        elif self.how == "each row mixed with a shuffled row (mixup)":
            h = 0.5 * h + 0.5 * h[torch.randperm(rows)]
        elif self.how == "every row scored against every other":
            return torch.nn.functional.cross_entropy(h @ h.t(), torch.arange(rows))
        elif self.how == "each row plus the row its label names":
            h = h + h.index_select(0, y)
        elif self.how == "rows scaled by how many there are":
            h = h * (rows / 8.0)
        elif self.how == "each row's own target picked by its place":  # rows apart: split
            h = h - h[torch.arange(rows), y][:, None]
        elif self.how == "scaled by the batch's largest value":
            h = h / h.abs().max()
        elif self.how == "scaled by the batch's norm":
            h = h / h.norm()
        elif self.how == "each row plus the one before":
            h = h + torch.roll(h, 1, 0)
        elif self.how == "each row plus its mirror":
            h = h + torch.flip(h, [0])
        elif self.how == "features rolled within a row":  # rows apart: split
            h = h + torch.roll(h, 1, 1)
        return torch.nn.functional.cross_entropy(self.head(h), y)


@pytest.mark.parametrize("how, named", [
    ("scaled by the batch's largest value", "aten::max"), ("scaled by the batch's norm", "aten::linalg_vector_norm"),
    ("each row plus the one before", "aten::roll"), ("each row plus its mirror", "aten::flip"),
    ("features rolled within a row", None), ("rows past a capacity dropped by their place", "aten::lt"),
    ("each row's place looked up in a table", "aten::embedding"),
    ("each row mixed with a shuffled row (mixup)", "aten::index"),
    ("every row scored against every other", "aten::matmul"), ("each row's own target picked by its place", None),
    ("each row plus the row its label names", "aten::index_select"), ("rows scaled by how many there are", "aten::mul"),
])
def test_rows_that_meet_are_found_naming_the_operator(how, named):
    """A statistic of the whole batch that the rows then use, values moved along the batch, a
    row's place in the call or the call's size read as data, rows taken by indices, and rows
    paired with rows make a share's rows depend on the others: found (user trials found them
    split). A row's place used only to pick from its own row is not."""
    graph = conveyor.capture(RowsMeet(how), (torch.randn(8, 16), torch.randint(0, 3, (8,))))
    found = where_samples_mix(graph.document)
    if named is None:
        assert found is None, found
    else:
        assert found is not None and found.startswith(named) and "test_batch_dimension.py" in found, found


HELPER = """import torch

def centre(h):
    h = torch.tanh(h)
    return h - h.mean(0)  # the operator's own line: 5
"""


class MixesInAHelper(torch.nn.Module):
    """Rows meet in a helper function of another package, called from forward."""

    def __init__(self, centre):
        super().__init__()
        self.centre, self.head = centre, torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.centre(x)), y)


def test_a_refusal_names_the_operators_own_line_in_a_helper_of_any_package(tmp_path, monkeypatch):
    """torch.export keeps only the frames named forward; the refusal names the helper's line
    (transformers' moe.py was cited at the line of forward that calls the experts)."""
    (tmp_path / "helpers_elsewhere").mkdir()
    (tmp_path / "helpers_elsewhere" / "__init__.py").write_text("")
    (tmp_path / "helpers_elsewhere" / "rows.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    from helpers_elsewhere.rows import centre
    net = MixesInAHelper(centre)
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), microbatches=2, replan="off",
                            verbose=False)
    line = r"aten::mean \(" + re.escape(f"{tmp_path}/helpers_elsewhere/rows.py:5") + r"\)"
    with pytest.raises(ConveyorValueError, match=line), pytest.warns(UserWarning, match=line):
        model.train_step(torch.randn(8, 16), torch.randint(0, 3, (8,)))


class TokensBatchNormed(torch.nn.Module):
    """BatchNorm1d over the tokens of every sample at once, as inside an expert block."""

    def __init__(self):
        super().__init__()
        self.norm, self.head = torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)

    def forward(self, x, y):
        h = self.norm(x.reshape(-1, 16))  # statistics over every token of the call
        return F.cross_entropy(self.head(h), y.reshape(-1))


def test_a_split_step_with_batch_statistics_in_training_warns_naming_the_operator():
    """Each share normalizes by its own samples' statistics (gradient accumulation's), which a
    split step says, naming the line; a whole call and an evaluation-mode norm say nothing."""
    x, y = torch.randn(8, 5, 16), torch.randint(0, 3, (8, 5))
    said = r"aten::batch_norm \(.*test_batch_dimension.py:\d+\) normalizes in training mode by statistics over dim 0"
    net = TokensBatchNormed()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), microbatches=2, replan="off",
                            verbose=False)
    with pytest.warns(UserWarning, match=said) as caught:
        model.train_step(x, y)
    assert any("each share the step splits it into (2 microbatches)" in str(w.message) for w in caught)
    for microbatches, mode in ((1, "train"), (2, "eval")):
        net = getattr(TokensBatchNormed(), mode)()
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), microbatches=microbatches,
                                replicas=1, replan="off", verbose=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.train_step(x, y)
        assert not [w for w in caught if "normalizes in training mode" in str(w.message)], (microbatches, mode)


class WithLoss(torch.nn.Module):
    """A small network and a loss of the kind named (how it combines the samples)."""

    LOSSES = {
        "cross entropy, summed": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
        "squares summed, then divided by the batch size": lambda out, y: out.pow(2).sum() / out.shape[0],
        "KL divergence, batchmean": lambda out, y: F.kl_div(F.log_softmax(out, -1), F.softmax(out.detach() * 2, -1),
                                                             reduction="batchmean"),
        "a mean over the batch, then a sum": lambda out, y: out.pow(2).mean(0).sum(),
        "binary cross entropy, summed, doubled": lambda out, y: 2 * F.binary_cross_entropy_with_logits(
            out, torch.ones_like(out), reduction="sum"),
        "root mean square": lambda out, y: F.mse_loss(out, out.detach() * 0.5).sqrt(),
    }

    def __init__(self, loss: str):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
        self.loss = WithLoss.LOSSES[loss]

    def forward(self, x, y):
        return self.loss(self.second(torch.tanh(self.first(x))), y)


@pytest.mark.parametrize("loss", [name for name in WithLoss.LOSSES if name != "root mean square"])
def test_a_split_step_of_a_summed_or_averaged_loss_equals_the_whole_batch(loss):
    """Each share's loss weighs 1 where the loss sums over the samples (their fraction of
    the batch where it averages): the step equals eager PyTorch on the whole batch."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        net = WithLoss(loss)
        ref = copy.deepcopy(net)
        x, y = torch.randn(8, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, microbatches=2,
                                replicas=2, replan="off")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # none of these warns
            for step in range(2):
                got = model.train_step(x, y).item()
                ref_opt.zero_grad()
                want = ref(x, y)
                want.backward()
                ref_opt.step()
                assert got == pytest.approx(want.item(), rel=TOLERANCE, abs=0), step
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
            assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_loss_neither_summed_nor_averaged_warns_naming_the_operator():
    net = WithLoss("root mean square")
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), stages=2, microbatches=2, replan="off")
    with pytest.warns(UserWarning, match=r"the loss is neither a mean nor a sum over the samples \(aten::sqrt "
                                         r"\(.*test_batch_dimension.py:\d+\) is not linear"):
        model.train_step(torch.randn(8, 8), torch.zeros(8, dtype=torch.long))


class RepeatedRows(torch.nn.Module):
    """Each sample repeated 3 times in place (several draws per sample), the loss a mean."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.tanh(x.repeat_interleave(3, dim=0))), y.repeat_interleave(3))


def test_rows_repeated_in_place_split_like_the_whole_batch_without_a_warning():
    """repeat_interleave keeps each sample's copies together, as a flattening does: a split
    step is the whole batch's (it warned that the loss was neither a mean nor a sum)."""
    torch.set_default_dtype(torch.float64)
    try:
        net = RepeatedRows()
        ref = copy.deepcopy(net)
        model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), microbatches=2, replan="off")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 4, 0])
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got = model.train_step(x, y).item()
        ref_opt.zero_grad()
        want = ref(x, y)
        want.backward()
        ref_opt.step()
        assert got == pytest.approx(want.item(), rel=TOLERANCE, abs=0)
        for p, q in zip(net.parameters(), ref.parameters()):
            assert (p - q).abs().max().item() <= TOLERANCE * max(q.abs().max().item(), 1.0)
    finally:
        torch.set_default_dtype(torch.float32)


class HalvesSwapped(torch.nn.Module):
    """The batch's first half against its second: export fixes the batch size."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        first, second = torch.tanh(x).chunk(2)
        return F.cross_entropy(self.head(torch.cat([second, first])), y)


def test_a_fixed_batch_size_is_said_with_the_check_that_fixed_it():
    """The warning names the check export found on the batch size (it named none, and the
    refusal pointed at it: a user trial)."""
    with pytest.warns(UserWarning, match=r"HalvesSwapped specializes its batch size \(it checks .*batch.*\)"):
        graph = conveyor.capture(HalvesSwapped(), (torch.randn(8, 16), torch.randint(0, 3, (8,))))
    assert not graph.dynamic_batch


class MaskedTokenMean(torch.nn.Module):
    """A per-token loss over flattened tokens, averaged over the tokens a mask keeps."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, y, mask):
        per_token = F.cross_entropy(self.head(x).reshape(-1, 5), y.reshape(-1), reduction="none")
        return (per_token * mask.reshape(-1)).sum() / mask.sum()


def test_a_masked_mean_over_flattened_tokens_warns_naming_its_division():
    """The per-token loss keeps the flattened tokens' rows (its size named after the target's
    sequence length, the logits' named apart): the warning names the division by the mask's
    count, not cross_entropy_loss (a user trial found it named so)."""
    net = MaskedTokenMean()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.05), microbatches=2, replan="off")
    x, y, mask = torch.randn(4, 3, 8), torch.randint(0, 5, (4, 3)), (torch.rand(4, 3) > 0.3).float()
    with pytest.warns(UserWarning, match=r"neither a mean nor a sum over the samples \(aten::div "
                                         r"\(.*test_batch_dimension.py:\d+\) is not linear"):
        model.train_step(x, y, mask)


if __name__ == "__main__":
    train_whole_across_processes()
