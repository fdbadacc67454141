"""Lightning's Trainer through conveyor (bindings/conveyor/lightning.py): a LightningModule
wrapping a tiny BERT trains under ConveyorStrategy (2 stages, 2 microbatches) with AdamW,
two accumulated batches a step, gradient_clip_val=1.0 and a validation loop, and what
Lightning logs and the trained parameters equal Lightning's own run without conveyor to 1e-9
in float64; Lightning's checkpoint has the model's own keys and resumes as Lightning resumes it."""
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import conveyor  # noqa: E402
from conveyor.lightning import ConveyorStrategy  # noqa: E402

import zoo  # noqa: E402
from zoo import Tokens  # noqa: E402

TOLERANCE = 1e-9


class LitBert(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.bert().model  # float64

    def training_step(self, batch, index):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):  # before Lightning clips
        self.log("grad_norm", torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]))

    def validation_step(self, batch, index):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(32, seed=1, padded=True), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(8, seed=2, padded=True), batch_size=4)


class Kept(pl.loggers.Logger):
    """Every metric Lightning logs, in order."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    name, version = "kept", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def fit(lit, strategy, tmp_path, resume=None, **changes):
    logger = Kept()
    settings = dict(accelerator="cpu", max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0,
                    val_check_interval=4, num_sanity_val_steps=0, logger=logger, log_every_n_steps=1,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                    callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"),
                                                            every_n_train_steps=2, save_top_k=-1)])
    trainer = pl.Trainer(strategy=strategy, **{**settings, **changes})
    trainer.fit(lit, ckpt_path=resume)
    return trainer, logger.metrics


def assert_same(ours, theirs, what):
    assert [(s, sorted(m)) for s, m in ours] == [(s, sorted(m)) for s, m in theirs], f"{what}: other metrics logged"
    for (step, x), (_, y) in zip(ours, theirs):
        for key in x:
            err = abs(x[key] - y[key]) / max(abs(y[key]), 1e-30)
            assert err <= TOLERANCE, f"{what}: step {step} {key} {x[key]} against {y[key]} ({err:.2e})"


def assert_same_parameters(a, b, what):
    # A parameter zero in exact arithmetic (an attention key's bias: softmax ignores a shift
    # shared by a row, so its gradient is round-off alone) is judged against a millionth of
    # the model's largest parameter, as test_exactness judges such gradients.
    floor = 1e-6 * max(q.abs().max().item() for q in b.parameters())
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        err = (p.detach() - q.detach()).abs().max().item() / max(q.abs().max().item(), floor)
        assert err <= TOLERANCE, f"{what}: {name} differs by {err:.2e}"


def test_lightning_trains_as_without_conveyor(tmp_path):
    theirs_lit, ours_lit = LitBert(), LitBert()
    _, theirs = fit(theirs_lit, "auto", tmp_path / "theirs", devices=1)
    strategy = ConveyorStrategy(devices=2, stages=2, microbatches=2)
    _, ours = fit(ours_lit, strategy, tmp_path / "ours")
    losses = [m["train_loss"] for _, m in ours if "train_loss" in m]
    assert len(losses) >= 4 and any("val_loss" in m for _, m in ours)
    assert any(m.get("grad_norm", 0) > 1.0 for _, m in ours), "gradient_clip_val=1.0 never clipped: no test of it"
    assert (strategy.conveyor_model.capture.layout.stages, strategy.conveyor_model.microbatches) == (2, 2)
    assert strategy.conveyor_model.capture_count == 2, "training and validation each ran their own capture"
    assert isinstance(ours_lit.model, conveyor.Module) is False, "after fit the attribute is the model again"
    assert_same(ours, theirs, "bert")
    assert_same_parameters(ours_lit, theirs_lit, "bert")


def test_a_lightning_checkpoint_resumes(tmp_path):
    """Resumed mid-epoch, Lightning starts the epoch's batches again (a plain DataLoader keeps
    no position): the resumed run is judged against Lightning's own resume of the same file."""
    fit(LitBert(), ConveyorStrategy(devices=2, stages=2, microbatches=2), tmp_path / "straight")
    saved = tmp_path / "straight" / "checkpoints" / "epoch=0-step=2.ckpt"
    keys = set(torch.load(saved, weights_only=False)["state_dict"])
    assert keys == set(LitBert().state_dict()), "the checkpoint holds the LightningModule's own keys"
    runs = {}
    for name, strategy in (("ours", ConveyorStrategy(devices=2, stages=2, microbatches=2)), ("theirs", "auto")):
        lit = LitBert()
        with torch.no_grad():
            for p in lit.parameters():
                p.add_(0.5)  # another start: only the checkpoint can make the runs equal
        devices = {"devices": 1} if name == "theirs" else {}
        _, metrics = fit(lit, strategy, tmp_path / name, resume=str(saved), **devices)
        runs[name] = lit, metrics
    assert [step for step, _ in runs["ours"][1]][0] == 2, "resumed at step 2"
    assert_same(runs["ours"][1], runs["theirs"][1], "resumed")
    assert_same_parameters(runs["ours"][0], runs["theirs"][0], "resumed")


def test_the_model_to_wrap_must_be_named_where_there_are_several(tmp_path):
    lit = LitBert()
    lit.head = torch.nn.Linear(2, 2)
    with pytest.raises(conveyor.ConveyorValueError, match="attribute='model'"):
        fit(lit, ConveyorStrategy(devices=2), tmp_path)
