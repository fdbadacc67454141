"""transformers' Trainer through conveyor (bindings/conveyor/trainer.py): a tiny GPT-2 and a
tiny Llama train with Trainer's AdamW, linear warmup, max_grad_norm=1.0, two accumulated
batches a step and evaluation every 2 steps, pipelined (2 stages, 2 microbatches), on rows
padded to random lengths (labels -100 past them: Trainer weighs each accumulated batch by its
label tokens, num_items_in_batch, and conveyor divides its summed loss alike), and
everything Trainer logs (losses, gradient norms, learning rates, evaluation losses) and the
trained parameters equal Trainer's own run without conveyor to 1e-9 in float64, in one process
and under torchrun --nproc-per-node 2 (trainer_worker.py); a checkpoint Trainer saved resumes
to the same result; what conveyor cannot honour is refused.

In float64 throughout: the default dtype too, so that Trainer's loss accumulator is float64,
and the models' causal-LM loss without transformers' cast of the logits to float32."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import conveyor  # noqa: E402
from conveyor.trainer import ConveyorTrainer  # noqa: E402

import zoo  # noqa: E402
from zoo import Tokens  # noqa: E402
from conftest import free_port  # noqa: E402

TOLERANCE = 1e-9
LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss")


def float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                           shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss without its `logits.float()`, which in a float64 model
    rounds to float32."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                       ignore_index=ignore_index,
                                       reduction="sum" if num_items_in_batch is not None else "mean")
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    net = getattr(zoo, name)().model
    net.loss_function = float64_causal_lm_loss
    # GPT2LMHeadModel's class name gives it no loss_type, so Trainer would count position 0 of
    # every row among the label tokens (a loss 15/16 of the model's own): name its loss.
    net.loss_type = "ForCausalLM"
    return net


def training_args(out, **changes) -> "transformers.TrainingArguments":
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                    gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, lr_scheduler_type="linear",
                    warmup_steps=2, max_grad_norm=1.0, eval_strategy="steps", eval_steps=2, logging_steps=1,
                    save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **changes})


def train(net, args, use_conveyor: bool, resume=None):
    data = dict(train_dataset=Tokens(32, seed=1, padded=True), eval_dataset=Tokens(8, seed=2, padded=True))
    if use_conveyor:
        trainer = ConveyorTrainer(model=net, args=args, conveyor=dict(devices=2, stages=2, microbatches=2), **data)
    else:
        trainer = transformers.Trainer(model=net, args=args, **data)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(trainer) -> list[dict]:
    return [{k: v for k, v in entry.items() if k in LOGGED} for entry in trainer.state.log_history
            if any(k in entry for k in LOGGED)]


def assert_same_run(ours, theirs, ours_net, theirs_net, what: str):
    a, b = logged(ours), logged(theirs)
    assert [sorted(e) for e in a] == [sorted(e) for e in b], f"{what}: other entries logged: {a} against {b}"
    for step, (x, y) in enumerate(zip(a, b)):
        for key in x:
            err = abs(x[key] - y[key]) / max(abs(y[key]), 1e-30)
            assert err <= TOLERANCE, f"{what}: entry {step} {key} {x[key]!r} against {y[key]!r} ({err:.2e})"
    # A parameter zero in exact arithmetic (a bias whose gradient is round-off alone) is judged
    # against a millionth of the model's largest parameter, as test_exactness judges such gradients.
    floor = 1e-6 * max(q.abs().max().item() for q in theirs_net.parameters())
    for (name, p), (_, q) in zip(ours_net.named_parameters(), theirs_net.named_parameters()):
        err = (p.detach() - q.detach()).abs().max().item() / max(q.abs().max().item(), floor)
        assert err <= TOLERANCE, f"{what}: parameter {name} differs by {err:.2e} after training"


@pytest.mark.parametrize("name, clips", [("gpt2", True), ("llama", False)])  # Llama's norms start near 0.8
def test_trainer_trains_as_without_conveyor(name, clips, tmp_path, float64):
    theirs_net, ours_net = tiny(name), tiny(name)
    theirs = train(theirs_net, training_args(tmp_path / "theirs"), use_conveyor=False)
    ours = train(ours_net, training_args(tmp_path / "ours"), use_conveyor=True)
    entries = logged(ours)
    assert sum("loss" in e for e in entries) == 4 and sum("eval_loss" in e for e in entries) == 2
    assert all(e["loss"] > 0 and math.isfinite(e["loss"]) for e in entries if "loss" in e)
    if clips:
        assert any(e.get("grad_norm", 0) > 1.0 for e in entries), "max_grad_norm=1.0 never clipped: no test of it"
    layout = ours.conveyor_model.capture.layout
    assert (layout.stages, layout.microbatches) == (2, 2), "the steps ran pipelined"
    assert ours.conveyor_model.capture_count == 2, "training and evaluation each ran their own capture"
    assert_same_run(ours, theirs, ours_net, theirs_net, name)
    inputs = [i["name"] for i in ours.conveyor_model.capture.graph.document["inputs"]]
    assert any("num_items_in_batch" in i for i in inputs), inputs


def test_a_checkpoint_resumes(tmp_path, float64):
    straight_net = tiny("gpt2")
    straight = train(straight_net, training_args(tmp_path / "straight", save_strategy="steps", save_steps=2),
                     use_conveyor=True)
    saved = tmp_path / "straight" / "checkpoint-2"
    assert (saved / "conveyor").is_dir() and (saved / "scheduler.pt").is_file() and \
        (saved / "trainer_state.json").is_file()
    resumed_net = tiny("gpt2")
    with torch.no_grad():  # another start, so that only the checkpoint can make them equal
        for p in resumed_net.parameters():
            p.add_(0.5)
    resumed = train(resumed_net, training_args(tmp_path / "resumed"), use_conveyor=True, resume=str(saved))
    assert resumed.state.global_step == 4
    # Steps 1 and 2 come from the checkpoint's trainer_state.json; 3, 4 and the evaluation after 4 ran again.
    assert [sorted(e) for e in logged(resumed)] == [sorted(e) for e in logged(straight)]
    for x, y in zip(logged(resumed)[-3:], logged(straight)[-3:]):
        for key in x:
            assert abs(x[key] - y[key]) <= TOLERANCE * abs(y[key]), f"resumed {key} {x[key]} against {y[key]}"
    floor = 1e-6 * max(q.abs().max().item() for q in straight_net.parameters())
    for (name, p), (_, q) in zip(resumed_net.named_parameters(), straight_net.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), floor)
        assert err <= TOLERANCE, f"{name} differs by {err:.2e} after resuming"


@pytest.mark.skipif(bool(conveyor._C.ucx_status()), reason=f"UCX cannot start here: {conveyor._C.ucx_status()}")
def test_torchrun_two_processes_train_as_one_process_without_conveyor(tmp_path):
    """The same script under torchrun --nproc-per-node 2 (Trainer's own data loading: each
    process its share of a step's batch) against Trainer alone on the shares together."""
    worker = Path(__file__).with_name("trainer_worker.py")
    env = dict(os.environ, UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(worker),
                          "--out", str(tmp_path / "two.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    one = subprocess.run([sys.executable, str(worker), "--alone", "2", "--out", str(tmp_path / "one.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, (one.stdout + one.stderr)[-4000:]
    ours, theirs = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert [sorted(e) for e in ours["logged"]] == [sorted(e) for e in theirs["logged"]]
    assert sum("eval_loss" in e for e in ours["logged"]) == 2
    assert any(e.get("grad_norm", 0) > 0.75 for e in ours["logged"]), "never clipped: no test of it"
    for step, (x, y) in enumerate(zip(ours["logged"], theirs["logged"])):
        for key in x:
            assert abs(x[key] - y[key]) <= TOLERANCE * abs(y[key]), f"entry {step} {key}: {x[key]} against {y[key]}"
    floor = 1e-6 * max(t.abs().max().item() for t in theirs["state"].values())
    for name, want in theirs["state"].items():
        err = (ours["state"][name] - want).abs().max().item() / max(want.abs().max().item(), floor)
        assert err <= TOLERANCE, f"{name} differs by {err:.2e} across processes"


def test_a_folder_of_another_kind_is_not_resumed(tmp_path):
    args = training_args(tmp_path / "run", eval_strategy="no")
    trainer = ConveyorTrainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(32))
    (tmp_path / "plain").mkdir()
    with pytest.raises(conveyor.ConveyorValueError, match="not a checkpoint ConveyorTrainer saved"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain"))


@pytest.mark.parametrize("change, says", [
    (dict(torch_compile=True), "drop torch_compile=True"),
    (dict(activation_checkpointing=True), "recompute=True"),
    (dict(load_best_model_at_end=True, save_strategy="steps"), "resume_from_checkpoint"),
    (dict(label_smoothing_factor=0.1), "smoothed loss"),
])
def test_what_conveyor_cannot_honour_is_refused(change, says, tmp_path):
    with pytest.raises(conveyor.ConveyorValueError, match=says):
        ConveyorTrainer(model=tiny("gpt2"), args=training_args(tmp_path, **change), train_dataset=Tokens(8))


def test_fsdp_and_deepspeed_are_refused(tmp_path):
    args = training_args(tmp_path)
    args.fsdp = ["full_shard"]  # set after construction: TrainingArguments checks it for a distributed run
    with pytest.raises(conveyor.ConveyorValueError, match="drop fsdp="):
        ConveyorTrainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(8))
    args = training_args(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # deepspeed itself need not be installed to be refused
    with pytest.raises(conveyor.ConveyorValueError, match="drop deepspeed="):
        ConveyorTrainer(model=tiny("gpt2"), args=args, train_dataset=Tokens(8))


def test_metrics_over_logits_are_refused(tmp_path):
    with pytest.raises(conveyor.ConveyorValueError, match="eval_loss is logged"):
        ConveyorTrainer(model=tiny("gpt2"), args=training_args(tmp_path), train_dataset=Tokens(8),
                        compute_metrics=lambda prediction: {})
