"""Pretrained weights (bindings/conveyor/pretrained.py): a transformers save_pretrained folder
loads into a conveyor job, each process reading only its tensors, and the job's first loss
is eager transformers' on the same weights; save_pretrained's folder loads back with
from_pretrained, without conveyor; a folder of another model or configuration, or a broken
one, is refused, naming what is wrong, before any tensor changes."""
import json
import sys
from pathlib import Path

import pytest
import torch

import conveyor
from conveyor import _C
from pretrained_worker import VOCAB, batch, next_token_loss, tiny_config
from test_launch import launch

transformers = pytest.importorskip("transformers")
WORKER = Path(__file__).with_name("pretrained_worker.py")
TOLERANCE = 1e-9
needs_ucx = pytest.mark.skipif(bool(_C.ucx_status()), reason=f"UCX cannot start here: {_C.ucx_status()}")


def reference(seed=0, **changes):
    """The pretrained model, as eager transformers holds it: float64, seeded weights that
    float32 could not hold."""
    torch.manual_seed(seed)
    net = transformers.GPT2LMHeadModel(tiny_config(**changes)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)
    return net


def eager_loss(net) -> float:
    ids = batch()
    with torch.no_grad():
        return next_token_loss(net(input_ids=ids), ids).item()


def wrapped(net):
    return conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), stages=2, loss_fn=next_token_loss,
                           replan="off")


def first_loss(model) -> float:
    ids = batch()
    return model(input_ids=ids, target=ids).item()


@needs_ucx
def test_a_sharded_folder_loads_into_a_two_process_job_and_its_export_loads_back_in_transformers(tmp_path):
    ref = reference()
    ref.save_pretrained(tmp_path / "gpt2", max_shard_size="20KB")  # several shards and their index
    assert len(json.loads((tmp_path / "gpt2" / "model.safetensors.index.json").read_text())["weight_map"]) > 20
    assert len(list((tmp_path / "gpt2").glob("model-*.safetensors"))) > 2
    code, out = launch("-n", 2, "--", sys.executable, WORKER, "--load", tmp_path / "gpt2", "--save",
                       tmp_path / "export", "--out", tmp_path / "r.pt")
    assert code == 0, out[-4000:]
    result = torch.load(tmp_path / "r.pt")
    assert result["world"] == 2 and result["stages"] == 2
    want = eager_loss(ref)
    assert result["loss"] == pytest.approx(want, rel=TOLERANCE, abs=0)
    # Each process read only what its stages read (the tied embedding, read by both ends, by both).
    names = [n for n in ref.state_dict() if n != "lm_head.weight"]
    reads = [json.loads((tmp_path / f"r.pt.reads{r}.json").read_text()) for r in range(2)]
    assert all(len(r) == len(set(r)) < len(names) for r in reads), [len(r) for r in reads]
    assert set(reads[0]) | set(reads[1]) == set(names)
    # The export: one shard per process, each tensor once, and transformers reads it alone.
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]
    assert sorted(index["weight_map"]) == sorted(names)  # lm_head.weight: tied, written once
    assert index["metadata"]["total_size"] == sum(ref.state_dict()[n].nbytes for n in names)
    assert not (tmp_path / "export.incomplete").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(back).__name__ == "GPT2LMHeadModel" and back.dtype == torch.float64
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert eager_loss(back) == pytest.approx(want, rel=TOLERANCE, abs=0)


def test_a_base_model_s_folder_loads_into_the_model_with_a_head_converted_and_its_export_is_one_file(tmp_path):
    """GPT2Model's folder (no "transformer." prefix, no head) in float32 loads into
    GPT2LMHeadModel in float64, as from_pretrained loads it; one process exports one file."""
    ref = reference()
    ref.transformer.float().save_pretrained(tmp_path / "base")
    ref = ref.double()  # the weights as float32 rounded them
    assert eager_loss(ref) != eager_loss(reference())
    model = wrapped(reference(seed=1))
    model.load_pretrained(tmp_path / "base")  # before the first call: read once the plan exists
    assert first_loss(model) == pytest.approx(eager_loss(ref), rel=TOLERANCE, abs=0)
    model.save_pretrained(tmp_path / "export")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "generation_config.json",
                                                                       "model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert eager_loss(back) == pytest.approx(eager_loss(ref), rel=TOLERANCE, abs=0)
    # And the other way: a model with a head's folder into the base model ("transformer." stripped).
    base = conveyor.Module(transformers.GPT2Model(tiny_config()).double(), stages=1,
                           loss_fn=lambda out, target: out.last_hidden_state.pow(2).mean(), replan="off")
    ids = batch()
    base(input_ids=ids, target=ids)
    base.load_pretrained(tmp_path / "export")  # after the first call: read at once
    for name, t in ref.transformer.state_dict().items():
        assert torch.equal(base.module.state_dict()[name], t), name


def _bad_folders(tmp_path: Path, safetensors) -> dict:
    good = reference()
    good.save_pretrained(tmp_path / "good", max_shard_size="20KB")
    state = {k: v.contiguous() for k, v in good.state_dict().items() if k != "lm_head.weight"}
    folders = {}
    for case in ("missing", "shape"):
        (tmp_path / case).mkdir()
        (tmp_path / case / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    safetensors.save_file({k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.weight"},
                          tmp_path / "missing" / "model.safetensors", metadata={"format": "pt"})
    folders["missing"] = (conveyor.ConveyorValueError, r"lacks 1 of the model's tensors \(transformer\.h\.1\.mlp"
                                                       r"\.c_fc\.weight.*build the model from the folder's config")
    safetensors.save_file(dict(state, **{"transformer.wpe.weight": torch.zeros(64, 32, dtype=torch.float64)}),
                          tmp_path / "shape" / "model.safetensors", metadata={"format": "pt"})
    folders["shape"] = (conveyor.ConveyorValueError, r"holds transformer\.wpe\.weight as \[64, 32\], the model's "
                                                     r"transformer\.wpe\.weight is \[32, 32\]")
    (tmp_path / "no_index").mkdir()
    (tmp_path / "no_index" / "config.json").write_text("{}")
    folders["no_index"] = (conveyor.ConveyorIOError, r"holds neither model\.safetensors\.index\.json nor "
                                                     r"model\.safetensors")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in (tmp_path / "good").glob("model-*"):
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors.index.json").write_text('{"weight_map": {"transformer.wte.weight": ')
    folders["corrupt"] = (conveyor.ConveyorValueError, r"index\.json is not a safetensors index \(JSONDecodeError")
    lost = tmp_path / "lost_shard"
    lost.mkdir()
    for f in (tmp_path / "good").iterdir():
        if f.name != "model-00002-of-00009.safetensors":
            (lost / f.name).write_bytes(f.read_bytes())
    folders["lost_shard"] = (conveyor.ConveyorIOError, r"model-00002-of-00009\.safetensors, which its index names, "
                                                       "is missing")
    folders["nothing"] = (conveyor.ConveyorIOError, "no pretrained folder at")
    return folders


def test_bad_folders_are_refused_naming_what_is_wrong_before_anything_changes(tmp_path):
    import safetensors.torch
    folders = _bad_folders(tmp_path, safetensors.torch)
    model = wrapped(reference(seed=3))
    first_loss(model)  # built: a load would change the tensors at once
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    for case, (error, message) in folders.items():
        with pytest.raises(error, match=message):
            model.load_pretrained(tmp_path / case)
        for k, v in model.module.state_dict().items():
            assert torch.equal(v, before[k]), (case, k)
    with pytest.raises(conveyor.ConveyorValueError, match="missing|lacks"):  # before the first call: refused now
        wrapped(reference(seed=3)).load_pretrained(tmp_path / "missing")
    extra = tmp_path / "extra"
    extra.mkdir()
    state = {k: v for k, v in reference().state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    safetensors.torch.save_file({**state, "other.weight": torch.zeros(3)},
                                extra / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"no use for 1 of .*'s tensors \(other\.weight\)"):
        model.load_pretrained(extra)
