"""Checkpoints (bindings/conveyor/checkpoint.py): a job saved on one plan and process count
resumes on another and trains exactly like one that never stopped; PyTorch's own DCP tools
read the folder; a corrupt, foreign, mismatched or unfinished checkpoint is refused, naming
what is wrong, before anything changes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conveyor
from conveyor import _C
from test_launch import launch

WORKER = Path(__file__).with_name("checkpoint_worker.py")
TOLERANCE = 1e-9
needs_ucx = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")


def alone(*args):
    run = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, UCX_NET_DEVICES="lo"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def job(n, *args):
    code, out = launch("-n", n, "--", sys.executable, WORKER, *map(str, args))
    assert code == 0, out[-4000:]


def assert_same_training(got: dict, want: dict):
    losses = got["losses"]
    assert losses == pytest.approx(want["losses"][-len(losses):], rel=TOLERANCE, abs=0)
    for key, w in want["state"].items():
        err = (got["state"][key] - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, (key, err)


@needs_ucx
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_job_resumed_on_another_plan_and_process_count_trains_as_if_it_never_stopped(optimizer, tmp_path):
    """4 steps on 2 processes (one stage, data parallel over both), saved; 4 more on 3
    processes (three stages, cut elsewhere) and on 1: each equals 8 uninterrupted steps
    (AdamW with an LR schedule whose state travels in extra=)."""
    alone("--optimizer", optimizer, "--steps", 8, "--out", tmp_path / "whole.pt")
    want = torch.load(tmp_path / "whole.pt")
    job(2, "--optimizer", optimizer, "--steps", 4, "--stages", 1, "--replicas", 2, "--save", tmp_path / "ck",
        "--out", tmp_path / "first.pt")
    first = torch.load(tmp_path / "first.pt")
    assert first["world"] == 2 and first["replicas"] == [2]
    assert first["losses"] == pytest.approx(want["losses"][:4], rel=TOLERANCE, abs=0)
    job(3, "--optimizer", optimizer, "--first", 4, "--steps", 4, "--stages", 3, "--load", tmp_path / "ck",
        "--out", tmp_path / "three.pt")
    three = torch.load(tmp_path / "three.pt")
    assert three["world"] == 3 and three["stages"] == 3
    assert_same_training(three, want)
    alone("--optimizer", optimizer, "--first", 4, "--steps", 4, "--stages", 2, "--load", tmp_path / "ck",
          "--out", tmp_path / "one.pt")
    assert_same_training(torch.load(tmp_path / "one.pt"), want)


@needs_ucx
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_whole_and_the_new_one_refused(tmp_path):
    job(2, "--steps", 2, "--stages", 2, "--save", tmp_path / "ck", "--out", tmp_path / "first.pt")
    code, out = launch("-n", 2, "--", sys.executable, WORKER, "--first", 2, "--steps", 2, "--stages", 2,
                       "--load", tmp_path / "ck", "--save", tmp_path / "ck", "--die-while-saving",
                       "--out", tmp_path / "second.pt")
    assert code != 0, out[-3000:]
    assert (tmp_path / "ck.incomplete").is_dir() and not (tmp_path / "ck.incomplete" / ".metadata").exists()
    alone("--first", 2, "--steps", 2, "--load", tmp_path / "ck", "--out", tmp_path / "again.pt")  # still loads
    with pytest.raises(conveyor.ConveyorIOError, match=r"\.metadata is missing"):
        _mlp_module().load_checkpoint(tmp_path / "ck.incomplete")


def _mlp_module(width=16, stages=2):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)).double()
    return conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                           loss_fn=torch.nn.functional.mse_loss, stages=stages, replan="off")


def _train(model, steps=2):
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        model.train_step(torch.randn(8, 16, generator=g, dtype=torch.float64),
                         target=torch.randn(8, 4, generator=g, dtype=torch.float64))


def test_pytorch_s_own_tool_reads_a_checkpoint_and_its_tensors_are_the_model_s(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    model = _mlp_module()
    _train(model)
    model.save_checkpoint(tmp_path / "ck")
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    for name, t in model.module.state_dict().items():
        assert torch.equal(plain[f"model.{name}"], t), name
    for p in model.module.parameters():  # SGD's momentum, each under its parameter's name
        name = next(n for n, q in model.module.named_parameters() if q is p)
        assert torch.equal(plain[f"optim.{name}.momentum_buffer"], model.optimizer.state[p]["momentum_buffer"])


def test_a_corrupt_tensor_is_refused_naming_it_and_nothing_changes(tmp_path):
    model = _mlp_module()
    _train(model)
    model.save_checkpoint(tmp_path / "ck")
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    where = raw.find(model.module.state_dict()["2.weight"].numpy().tobytes())  # its bytes, stored as they are
    assert where > 0
    raw[where + 3] ^= 0x40
    data.write_bytes(bytes(raw))
    other = _mlp_module()
    _train(other, 1)
    before = {k: v.clone() for k, v in other.module.state_dict().items()}
    with pytest.raises(conveyor.ConveyorIOError, match=r"model\.2\.weight is corrupt"):
        other.load_checkpoint(tmp_path / "ck")
    for k, v in other.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_checkpoints_of_another_model_a_foreign_format_or_no_folder_are_refused_before_any_work(tmp_path):
    model = _mlp_module()
    _train(model)
    model.save_checkpoint(tmp_path / "ck")
    with pytest.raises(conveyor.ConveyorValueError, match=r"holds 0\.weight as \[16, 16\].*\[32, 32\]"):
        _mlp_module(width=32).load_checkpoint(tmp_path / "ck")
    import torch.distributed.checkpoint as dcp
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "foreign", no_dist=True)
    with pytest.raises(conveyor.ConveyorValueError, match="not one conveyor wrote"):
        _mlp_module().load_checkpoint(tmp_path / "foreign")
    with pytest.raises(conveyor.ConveyorIOError, match="no checkpoint at"):
        _mlp_module().load_checkpoint(tmp_path / "nothing")
    (tmp_path / "ck" / "__0_0.distcp").unlink()
    with pytest.raises(conveyor.ConveyorIOError, match=r"__0_0\.distcp is missing"):
        _mlp_module().load_checkpoint(tmp_path / "ck")


def test_a_checkpoint_loaded_before_the_first_call_is_read_once_the_plan_exists(tmp_path):
    model = _mlp_module()
    _train(model, 3)
    model.save_checkpoint(tmp_path / "ck", extra={"epoch": 7})
    resumed = _mlp_module(stages=1)
    assert resumed.load_checkpoint(tmp_path / "ck") == {"epoch": 7}
    _train(resumed, 1)
    model_next = _mlp_module()
    model_next.load_checkpoint(tmp_path / "ck")
    _train(model_next, 1)
    for a, b in zip(resumed.module.parameters(), model_next.module.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)


def test_a_background_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path):
    model = _mlp_module()
    _train(model, 2)
    at_save = {k: v.clone() for k, v in model.module.state_dict().items()}
    saving = model.save_checkpoint(tmp_path / "ck", extra={"epoch": 1}, background=True)
    _train(model, 2)  # changes every parameter while the thread writes the copy
    assert model.load_checkpoint(tmp_path / "ck") == {"epoch": 1}  # waits for the save, then loads it
    saving.wait()
    assert saving.done() and not (tmp_path / "ck.incomplete").exists()
    resumed = _mlp_module(stages=1)
    assert resumed.load_checkpoint(tmp_path / "ck") == {"epoch": 1}
    x = torch.zeros(2, 16, dtype=torch.float64)
    with torch.no_grad():
        resumed(x, target=torch.zeros(2, 4, dtype=torch.float64))  # the first call reads it
    for k, v in resumed.module.state_dict().items():
        assert torch.equal(v, at_save[k]), k


def test_a_background_save_that_fails_is_raised_by_its_wait_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    from conveyor import checkpoint_save
    model = _mlp_module()
    _train(model, 1)
    model.save_checkpoint(tmp_path / "ck")

    def disk_full(t):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint_save, "checksum", disk_full)
    saving = model.save_checkpoint(tmp_path / "ck", background=True)
    with pytest.raises(conveyor.ConveyorIOError, match=r"did not complete: OSError.*No space left"):
        saving.wait()
    assert (tmp_path / "ck.incomplete" / ".failed.0").is_file()
    _mlp_module().load_checkpoint(tmp_path / "ck")  # the previous one is whole
    monkeypatch.undo()
    model.save_checkpoint(tmp_path / "ck", background=True)
    model.load_checkpoint(tmp_path / "ck")  # waits for the save first, then finds it complete


@needs_ucx
def test_a_job_saved_in_the_background_on_two_processes_resumes_exactly(tmp_path):
    """AdamW on 2 processes, two stages: saved in the background after 4 steps while 2 more
    run; resumed alone from it, 4 more steps equal 8 uninterrupted ones."""
    alone("--optimizer", "adamw", "--steps", 8, "--out", tmp_path / "whole.pt")
    want = torch.load(tmp_path / "whole.pt")
    job(2, "--optimizer", "adamw", "--steps", 4, "--stages", 2, "--save", tmp_path / "ck", "--background",
        "--out", tmp_path / "first.pt")
    alone("--optimizer", "adamw", "--first", 4, "--steps", 4, "--load", tmp_path / "ck", "--out", tmp_path / "one.pt")
    assert_same_training(torch.load(tmp_path / "one.pt"), want)


def test_tensors_stored_row_major_are_read_in_place_and_others_through_dcp_alike(tmp_path):
    """A channels_last convolution weight is stored with its own strides: it is not read in
    place (checkpoint_read.locate) but through DCP, and loads equal all the same."""
    from conveyor import checkpoint

    def conv_module():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2)).double()
        net[0].weight.data = net[0].weight.data.to(memory_format=torch.channels_last)
        return conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                               loss_fn=torch.nn.functional.mse_loss, stages=1, replan="off")
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    model = conv_module()
    model.train_step(x, target=y)
    model.save_checkpoint(tmp_path / "ck")
    _, metadata = checkpoint.read_meta(tmp_path / "ck")
    located = checkpoint._located(tmp_path / "ck", metadata, ["model.0.weight", "model.2.weight"])
    assert located["model.0.weight"] is None and located["model.2.weight"] is not None
    other = conv_module()
    other.load_checkpoint(tmp_path / "ck")
    with torch.no_grad():
        other(x, target=y)  # the first call reads it
    for (name, a), b in zip(model.module.state_dict().items(), other.module.state_dict().values()):
        assert torch.equal(a, b), name


def test_dropout_draws_are_the_job_s_and_a_resumed_job_draws_on_as_one_that_never_stopped(tmp_path):
    """Dropout draws from the job's seed and the step's number in the job: two runs draw
    alike, and 4 steps, a checkpoint, and 4 more on the same plan equal 8 steps (the seed and
    the step count travel in the checkpoint)."""
    alone("--dropout", 0.3, "--steps", 8, "--stages", 2, "--out", tmp_path / "whole.pt")
    alone("--dropout", 0.3, "--steps", 8, "--stages", 2, "--out", tmp_path / "again.pt")
    whole = torch.load(tmp_path / "whole.pt")
    assert torch.load(tmp_path / "again.pt")["losses"] == whole["losses"]
    alone("--dropout", 0.3, "--steps", 4, "--stages", 2, "--save", tmp_path / "ck", "--out", tmp_path / "first.pt")
    alone("--dropout", 0.3, "--first", 4, "--steps", 4, "--stages", 2, "--load", tmp_path / "ck",
          "--out", tmp_path / "resumed.pt")
    assert_same_training(torch.load(tmp_path / "resumed.pt"), whole)


def test_a_save_keeps_the_folder_s_other_files_and_refuses_a_file_in_its_place(tmp_path):
    model = _mlp_module()
    _train(model, 1)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "train.log").write_text("kept")
    model.save_checkpoint(folder)
    model.save_checkpoint(folder)  # again over the last one: its own files replaced, the log kept
    assert (folder / "train.log").read_text() == "kept" and (folder / ".metadata").is_file()
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(conveyor.ConveyorValueError, match="is a file, not a folder: save_checkpoint writes a folder"):
        model.save_checkpoint(tmp_path / "notes")
    assert (tmp_path / "notes").read_text() == "mine" and not (tmp_path / "notes.incomplete").exists()
    here = os.getcwd()
    try:
        os.chdir(folder)
        model.save_checkpoint(".")  # the folder named by "."
    finally:
        os.chdir(here)
    assert (folder / ".metadata").is_file() and (folder / "train.log").exists()


def test_a_checkpoint_of_another_optimizer_or_a_larger_model_is_refused_and_set_hyperparameters_stay(tmp_path):
    model = _mlp_module()
    _train(model, 1)
    model.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    adam = conveyor.Module(net, torch.optim.AdamW(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(conveyor.ConveyorValueError, match="saved with a SGD optimizer, this model's is AdamW"):
        adam.load_checkpoint(tmp_path / "ck")
    smaller = torch.nn.Sequential(torch.nn.Linear(16, 16)).double()  # the first layer alone
    with pytest.raises(conveyor.ConveyorValueError, match=r"holds 2 tensors the model does not have \(2\.weight, "
                                                          r"2\.bias\)"):
        conveyor.Module(smaller, loss_fn=torch.nn.functional.mse_loss).load_checkpoint(tmp_path / "ck")
    resumed = _mlp_module()
    resumed.load_checkpoint(tmp_path / "ck")
    resumed.optimizer.param_groups[0]["lr"] = 0.123  # set after the load: kept, as with torch's own load
    _train(resumed, 1)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.123


def test_a_load_that_fails_at_the_first_call_fails_every_call_after(tmp_path):
    model = _mlp_module()
    _train(model, 2)
    model.save_checkpoint(tmp_path / "ck")
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[raw.find(model.module.state_dict()["0.weight"].numpy().tobytes()) + 5] ^= 0x10
    data.write_bytes(bytes(raw))
    resumed = _mlp_module()
    resumed.load_checkpoint(tmp_path / "ck")  # checked against the index now; the bytes once the plan exists
    for _ in range(2):
        with pytest.raises(conveyor.ConveyorIOError, match=r"model\.0\.weight is corrupt"):
            _train(resumed, 1)


CALLS = r'''
import sys, torch, conveyor
out, case = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss, stages=2)
x, y = torch.ones(4, 8, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64)
model.train_step(x, target=y)
if case == "folders":
    model.save_checkpoint(f"{out}/ck{model.rank}")
elif model.rank == 0:
    model.save_checkpoint(f"{out}/ck")
model.train_step(x, target=y)
'''


@needs_ucx
@pytest.mark.parametrize("case, said", [
    ("folders", "save_checkpoint was called with another folder on processes [1] than on process 0"),
    ("one process", "process 0 is in save_checkpoint while process 1 is in call 2's batch check: every process must "
                    "make the same calls in the same order")])
def test_a_save_called_differently_across_processes_is_refused_naming_how(case, said, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(CALLS)
    code, out = launch("-n", 2, "--", sys.executable, script, tmp_path, case)
    assert code != 0
    assert said in out, out[-3000:]
    assert not (tmp_path / "ck0").exists() and not (tmp_path / "ck").exists()
