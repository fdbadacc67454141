"""A conveyor.Module looks like the model it wraps to code that inspects it
(bindings/conveyor/as_model.py): forward's signature, the type a call returns with
returns="model", and the model's describing attributes, or a refusal naming what to do."""
import inspect

import pytest
import torch
import torch.nn as nn

import conveyor

import zoo


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return {"loss": ((out - y) ** 2).mean(), "out": out}


def module(net, **options):
    return conveyor.Module(net, torch.optim.SGD(net.parameters(), lr=0.1), devices=2, stages=2, microbatches=2,
                           verbose=False, **options)


def test_forward_is_signed_as_the_model():
    net = DictNet()
    assert inspect.signature(module(net).forward) == inspect.signature(net.forward)
    with_target = module(nn.Linear(8, 1), loss_fn=nn.MSELoss())  # model(x, target=y): loss_fn(model(x), y)
    assert list(inspect.signature(with_target.forward).parameters) == ["input", "target"]


def test_a_dict_comes_back_a_dict_of_the_loss():
    torch.manual_seed(0)
    net, x, y = DictNet().double(), torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    eager = net(x, y)["loss"]
    out = module(net, returns="model")(x, y)
    assert type(out) is dict and list(out) == ["loss"]
    assert abs(out["loss"].item() - eager.item()) <= 1e-12 * abs(eager.item())
    out["loss"].backward()
    assert net.a.weight.grad is not None
    plain = module(DictNet().double())(x, y)
    assert isinstance(plain, torch.Tensor) and plain.dim() == 0  # returns="loss", the default: the tensor


def test_a_model_output_comes_back_of_its_type():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    case = zoo.gpt2()
    model = module(case.model, returns="model")
    trained = model(**case.kwargs)
    assert type(trained) is type(case.model(**case.kwargs))
    assert trained.logits is None and trained[0] is trained.loss and trained["loss"] is trained.loss
    trained.loss.backward()
    with torch.no_grad():
        evaluated = model(**case.kwargs)
    assert type(evaluated) is type(trained) and abs(evaluated.loss.item() - trained.loss.item()) <= 1e-12


def test_the_models_description_is_the_models_and_the_rest_is_refused():
    pytest.importorskip("transformers")
    net = zoo.gpt2().model
    model = module(net)
    assert model.config is net.config and model.generation_config is net.generation_config
    assert model.main_input_name == "input_ids" and model.can_generate() is False
    assert model.accepts_loss_kwargs is False
    with pytest.raises(conveyor.UnsupportedError, match="recompute=True"):
        model.gradient_checkpointing_enable()
    with pytest.raises(conveyor.UnsupportedError, match="generation is not pipelined"):
        model.generate(torch.zeros(1, 4, dtype=torch.long))
    assert not hasattr(model, "no_sync")  # what is not the model's description is not forwarded
    with pytest.raises(AttributeError, match="model.module"):
        model.lm_head_bias


def test_trainer_keeps_the_columns_the_model_takes(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = module(zoo.gpt2().model, returns="model")
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    trainer._set_signature_columns_if_needed()  # what Trainer drops the dataset's other columns by
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)


def test_returns_is_checked():
    with pytest.raises(conveyor.ConveyorValueError, match="returns='logits'"):
        module(DictNet(), returns="logits")
