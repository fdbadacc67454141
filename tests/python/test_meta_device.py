"""Models built on the meta device (bindings/conveyor/materialize.py): captured without real
tensors, profiled unit by unit, each process making only what its stages read; trained
exactly as the same model built eagerly from the same state; initialized the same whatever
the plan; bad input refused, named, before any work."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conveyor
from conveyor import _C
from conveyor.materialize import adopt_meta_model, materialize
from test_launch import launch

WORKER = Path(__file__).with_name("checkpoint_worker.py")
TOLERANCE = 1e-9
needs_ucx = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")


def alone(*args):
    run = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def meta_state(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, folder.with_suffix(".pt"))
    plain = torch.load(folder.with_suffix(".pt"), weights_only=False)
    return {k[len("model."):]: v for k, v in plain.items() if k.startswith("model.")}


def assert_like(got_losses, got_state, want):
    assert got_losses == pytest.approx(want["losses"], rel=TOLERANCE, abs=0)
    for key, w in want["state"].items():
        err = (got_state[key] - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        assert err <= TOLERANCE, (key, err)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_meta_built_model_from_the_same_state_trains_as_the_eager_one(optimizer, tmp_path):
    alone("--optimizer", optimizer, "--steps", 4, "--out", tmp_path / "eager.pt")
    alone("--optimizer", optimizer, "--steps", 0, "--save", tmp_path / "start", "--out", tmp_path / "start.pt")
    alone("--optimizer", optimizer, "--steps", 4, "--meta", "--load", tmp_path / "start", "--stages", 2,
          "--out", tmp_path / "meta.pt")
    got = torch.load(tmp_path / "meta.pt")
    assert_like(got["losses"], meta_state(Path(f"{tmp_path / 'meta.pt'}.state")), torch.load(tmp_path / "eager.pt"))


@needs_ucx
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("processes,stages", [(2, 2), (4, 4)])
def test_across_processes_a_meta_built_model_trains_as_the_eager_one(processes, stages, optimizer, tmp_path):
    alone("--optimizer", optimizer, "--steps", 4, "--out", tmp_path / "eager.pt")
    alone("--optimizer", optimizer, "--steps", 0, "--save", tmp_path / "start", "--out", tmp_path / "start.pt")
    code, out = launch("-n", processes, "--", sys.executable, WORKER, "--optimizer", optimizer, "--steps", 4, "--meta",
                       "--load", tmp_path / "start", "--stages", stages, "--out", tmp_path / "meta.pt")
    assert code == 0, out[-4000:]
    got = torch.load(tmp_path / "meta.pt")
    assert got["world"] == processes
    assert_like(got["losses"], meta_state(Path(f"{tmp_path / 'meta.pt'}.state")), torch.load(tmp_path / "eager.pt"))


@needs_ucx
def test_the_model_s_own_initializers_give_the_same_model_on_another_plan_and_process_count(tmp_path):
    """Built on the meta device and initialized by its own reset_parameters: one process with
    three stages and two processes with two stages each make the same first values (one
    SGD step later, equal up to summation order)."""
    alone("--optimizer", "sgd", "--steps", 1, "--meta", "--stages", 3, "--out", tmp_path / "one.pt")
    code, out = launch("-n", 2, "--", sys.executable, WORKER, "--optimizer", "sgd", "--steps", 1, "--meta",
                       "--stages", 2, "--out", tmp_path / "two.pt")
    assert code == 0, out[-4000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world"], one["stages"], two["world"], two["stages"]) == (1, 3, 2, 2)
    assert_like(two["losses"], meta_state(Path(f"{tmp_path / 'two.pt'}.state")),
                dict(losses=one["losses"], state=meta_state(Path(f"{tmp_path / 'one.pt'}.state"))))


def _gpt2(meta: bool):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.GPT2LMHeadModel(config)


def test_a_tensor_s_first_values_depend_on_the_seed_and_its_name_not_on_what_else_a_process_makes():
    whole, half = _gpt2(True), _gpt2(True)
    adopt_meta_model(whole, None)
    adopt_meta_model(half, None)
    names = [n for n, _ in whole.named_parameters()]
    materialize(whole, list(whole.parameters()), torch.device("cpu"), seed=7)
    chosen = dict(half.named_parameters())
    materialize(half, [chosen[n] for n in names[1::2]], torch.device("cpu"), seed=7)
    made = dict(whole.named_parameters())
    for n in names[1::2]:
        assert torch.equal(made[n], chosen[n]), n
    # The model's own scheme: GPT-2's scaled projections (its _init_weights on their parent).
    eager = dict(_gpt2(False).named_parameters())
    for n in ("transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_fc.weight"):
        assert made[n].std().item() == pytest.approx(eager[n].std().item(), rel=0.15), n


def _meta_mlp():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _step(model):
    g = torch.Generator().manual_seed(0)
    return model.train_step(torch.randn(8, 8, generator=g, dtype=torch.float64),
                            target=torch.randn(8, 2, generator=g, dtype=torch.float64))


def test_bad_meta_models_are_refused_naming_what_is_wrong():
    mixed = _meta_mlp()
    mixed[2] = torch.nn.Linear(8, 2).double()
    with pytest.raises(conveyor.ConveyorValueError, match=r"on the meta device \(0\.weight.*are real \(2\.weight"):
        conveyor.Module(mixed, loss_fn=torch.nn.functional.mse_loss)
    net = _meta_mlp()
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(conveyor.ConveyorValueError, match="tensors the model built on the meta device does not have"):
        conveyor.Module(net, torch.optim.SGD([*net.parameters(), stranger], lr=0.1), loss_fn=torch.nn.functional.mse_loss)
    net = _meta_mlp()  # refused in the constructor: init ran once on the meta device
    with pytest.raises(conveyor.ConveyorValueError, match=r"init\('0\.bias'\) returned \(3,\); 0\.bias is \(8,\)"):
        conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                        init=lambda name, meta: torch.zeros(3))
    net = _meta_mlp()  # an init that needs real tensors (through numpy) is checked when it runs
    wrong = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                            init=lambda name, meta: torch.from_numpy(torch.zeros(3).numpy()), replan="off")
    with pytest.raises(conveyor.ConveyorValueError, match=r"init\('0\.bias'\) returned \(3,\); 0\.bias is \(8,\)"):
        _step(wrong)


class _Scale(torch.nn.Module):
    """A module with a parameter and no way to initialize it."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(8, dtype=torch.float64))

    def forward(self, x):
        return x * self.gain


def test_a_module_nothing_initializes_is_named():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 8).double(), _Scale(), torch.nn.Linear(8, 2).double())
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                            replan="off")
    with pytest.raises(conveyor.ConveyorValueError, match=r"no initializer sets 1\.gain \(module 1"):
        _step(model)


def test_a_meta_built_model_refuses_to_be_gathered_whole():
    net = _meta_mlp()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                            replan="off")
    _step(model)
    with pytest.raises(conveyor.ConveyorValueError, match="save_checkpoint"):
        model.state_dict()


def test_init_gives_the_first_values_and_a_meta_built_model_trains():
    net = _meta_mlp()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                            init=lambda name, meta: torch.full(meta.shape, 0.1, dtype=meta.dtype), replan="off")
    first = _step(model).item()
    assert all(not p.is_meta for p in net.parameters())
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    for p in eager.parameters():
        torch.nn.init.constant_(p, 0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)
    assert first == pytest.approx(torch.nn.functional.mse_loss(eager(x), y).item(), rel=1e-12)


PROFILE_UNDER_A_CAP = r'''
import resource, sys, torch
import conveyor
from conveyor.materialize import adopt_meta_model, exported_on_meta

def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4096, 4096) for _ in range(16))  # 1 GiB of weights
    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()

with torch.device("meta"):
    net = Stack()
adopt_meta_model(net, None)
x = torch.randn(4, 4096)
with exported_on_meta(net) as own:
    graph = conveyor.capture(net, (x.to("meta"),), meta_runs_on=torch.device("cpu"))
graph.rebind({name: own.get(id(t), t) for name, t in graph.tensors.items()})
cap = vm("VmData:") + (384 << 20)  # a third of the weights beyond what the process holds now
resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
before = vm("VmHWM:")
doc = conveyor.profile(graph, (x,), cache=False, repeats=1)
print("units", doc["units"], "measured", doc["units_measured"], "peak_growth", vm("VmHWM:") - before)
'''


def test_a_model_larger_than_the_profiler_s_memory_cap_is_profiled_unit_by_unit_each_kind_once():
    """1 GiB of weights, profiled under a data limit 384 MiB above what the process holds:
    each unit's weights exist only while it is measured, and the 16 layers alike are
    measured once."""
    run = subprocess.run([sys.executable, "-c", PROFILE_UNDER_A_CAP], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    words = run.stdout.split()
    units, measured, growth = int(words[1]), int(words[3]), int(words[5])
    print(run.stdout)
    assert measured < units / 2, run.stdout
    assert growth < 384 << 20, run.stdout


@needs_ucx
def test_two_processes_train_a_model_whose_training_state_neither_may_hold(tmp_path):
    """bench/big_model.py, small: a GPT-2 built on the meta device in each of 2 processes,
    each allowed to grow its data by 0.9 of the whole model's training state (parameters,
    gradients, AdamW's moments): it trains, the loss going down."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "big_model.py"
    run = subprocess.run([str(a) for a in [sys.executable, bench, "--layers", 6, "--hidden", 1024, "--vocab", 8192, "--seq", 16,
                          "--processes", 2, "--limit-mb", 0.9, "--steps", 3, "--out", tmp_path]],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(run.stdout)
    losses = [float(x) for x in run.stdout.split("losses: ")[1].splitlines()[0].split(", ")]
    assert losses[-1] < losses[0], run.stdout
    assert "on 2 processes" in run.stdout


def test_a_meta_built_model_saved_before_its_tensors_exist_is_refused(tmp_path):
    net = _meta_mlp()
    model = conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(conveyor.ConveyorValueError, match="have no values yet"):
        model.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


EVERYTHING_ELSE = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import conveyor, zoo, transformers
transformers.logging.set_verbosity_error()
config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # use_cache as transformers sets it
torch.manual_seed(0)
with torch.device("meta"):
    net = transformers.GPT2LMHeadModel(config).double()
model = conveyor.Module(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stages=2, trace=sys.argv[1] + "/t.json")
draws = torch.Generator().manual_seed(0)
out = []
for k, n in enumerate([8, 8, 12, 8, 16, 8]):
    batch = zoo.padded_tokens(8, n, 96, draws)
    out.append(model.train_step(**batch).item())
    if k == 3:
        model.eval()
        with torch.no_grad():
            out.append(model(**batch).item())
        model.train()
norm = model.clip_grad_norm_(1.0).item()
model.save_checkpoint(sys.argv[1] + "/ck")
json.dump(dict(losses=out, norm=norm, captures=model.capture_count, replans=len(model.replans),
               held=sum(p.numel() for p in net.parameters()), whole=sum(p.numel() for p in
               transformers.GPT2LMHeadModel(config).parameters())),
          open(f"{sys.argv[1]}/rank{model.rank}.json", "w"))
'''


@needs_ucx
def test_a_meta_built_model_evaluates_grows_its_sizes_clips_and_saves_across_processes(tmp_path):
    """Two processes, stages cut in two, transformers' default config (use_cache): a longer
    sequence plans again (profiled without gathering the model), an evaluation takes its own
    capture, clip_grad_norm_ and a checkpoint work, each process writes its own trace, and
    the processes agree on every loss and the norm."""
    script = tmp_path / "job.py"
    script.write_text(EVERYTHING_ELSE)
    code, out = launch("-n", 2, "--", sys.executable, script, tmp_path, Path(__file__).parent)
    assert code == 0, out[-4000:]
    ranks = [__import__("json").loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["norm"] == ranks[1]["norm"]
    assert ranks[0]["captures"] == 2 and ranks[0]["replans"] >= 2, ranks[0]
    assert all(r["held"] < r["whole"] for r in ranks), ranks  # neither process made the whole model
    assert (tmp_path / "ck" / ".metadata").exists()
    assert (tmp_path / "t.rank0.json").exists() and (tmp_path / "t.rank1.json").exists()
