"""Messages a torchrun user meets, each saying what to do: a target passed under the model's
own name with loss_fn=, a loss_fn that cannot take the model's dict output, a cluster file
with a typo (named with its line), and one that describes another machine. (A batch smaller
than the plan's microbatches points to drop_last: tests/runtime/layout_test.cc.)"""
import subprocess
import sys

import pytest
import torch

import conveyor


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)


class DictOut(MLP):
    def forward(self, x):
        return {"logits": self.layer(x)}


def test_a_target_passed_as_labels_with_loss_fn_is_named_and_target_suggested():
    model = conveyor.Module(MLP(), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(conveyor.ConveyorValueError, match=r"MLP\.forward\(\) takes no argument 'labels'; with loss_fn= "
                                                          r"the target goes as target=: model\(x, target=y\)"):
        model(torch.randn(8, 4), labels=torch.randn(8, 2))


def test_a_loss_fn_that_cannot_take_a_dict_output_says_so_naming_the_model_not_a_wrapper():
    model = conveyor.Module(DictOut(), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(conveyor.CaptureError) as caught:
        model(torch.randn(8, 4), target=torch.randn(8, 2))
    text = str(caught.value)
    assert text.startswith("cannot capture DictOut: loss_fn(output, target) failed"), text
    assert "the model returns a dict with keys ['logits'], not a tensor; pass a loss_fn that takes it" in text


def test_a_cluster_file_with_a_typo_is_refused_in_the_constructor_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "site.toml"
    bad.write_text('[cluster]\nname = "x"\n[[node]\nname = "a"\n')
    with pytest.raises(conveyor.GraphFormatError, match=rf"{bad}:3: not valid TOML"):
        conveyor.Module(MLP(), loss_fn=torch.nn.functional.mse_loss, cluster=bad)


def test_a_cluster_file_of_another_machine_is_warned_of():
    from pathlib import Path
    dgx = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "dgx-h100-16.toml"
    with pytest.warns(UserWarning, match=r"dgx-h100-16\.toml describes 128 devices on 16 nodes, but this job runs on "
                                         r"2 virtual devices of this process's CPU: the plan uses 2 of the file's"):
        conveyor.Module(MLP(), loss_fn=torch.nn.functional.mse_loss, cluster=dgx, devices=2)


def test_torchvision_s_faster_rcnn_is_refused_naming_its_own_line_and_what_to_change():
    """A size drawn from a tensor (`int(torch.empty(1).uniform_(...).item())` in torchvision's
    detection transform) is named where it is, in torchvision, not at the caller's line."""
    torchvision = pytest.importorskip("torchvision")
    detector = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3)

    class Detection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.detector = detector

        def forward(self, images):
            targets = [{"boxes": torch.tensor([[1.0, 1.0, 20.0, 20.0]]), "labels": torch.tensor([1])}
                       for _ in range(images.shape[0])]
            return sum(self.detector(list(images), targets).values())
    model = conveyor.Module(Detection(), torch.optim.SGD(detector.parameters(), lr=0.01))
    with pytest.raises(conveyor.CaptureError) as caught:
        model.train_step(torch.rand(2, 3, 64, 64))
    text = str(caught.value)
    assert "torchvision/models/detection/transform.py:176" in text, text
    assert "reads a tensor's value as a Python number (.item(), int(tensor)) and uses it as a size or an index" in text


def test_the_first_call_says_each_phase_in_a_line_unless_asked_not_to(capfd):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = conveyor.Module(net, loss_fn=torch.nn.functional.mse_loss)
    model(torch.randn(8, 4), target=torch.randn(8, 2))
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("conveyor: ")]
    assert [line.split(":")[1].split()[0] for line in lines] == ["captured", "profiled", "planned", "built"], lines
    assert lines[0].startswith("conveyor: captured Sequential: ") and " measured (the others alike)" in lines[1]
    assert "predicted step" in lines[2], lines
    quiet = conveyor.Module(net, loss_fn=torch.nn.functional.mse_loss, verbose=False)
    quiet(torch.randn(8, 4), target=torch.randn(8, 2))
    assert "conveyor: " not in capfd.readouterr().err


TORCH_SPEAKS = """
import torch, conveyor
class Sum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
    def forward(self, x):
        print("the model's own print")
        h = self.layer(x)
        if h.sum() > 0:
            h = -h
        return h.pow(2).mean()
try:
    conveyor.capture(Sum(), (torch.randn(6, 4),))
except conveyor.CaptureError as e:
    print("refused:", str(e).splitlines()[0][:60])
"""


def test_torch_export_says_nothing_of_its_own_on_a_refused_capture():
    """Each failed attempt of torch.export printed the partial graph to stderr and logged
    'Unable to find user code' (several screens for one refusal); conveyor's error says it
    once. The model's own prints still reach the user."""
    r = subprocess.run([sys.executable, "-c", TORCH_SPEAKS], capture_output=True, text=True, timeout=120)
    assert "refused: cannot capture Sum" in r.stdout, r.stdout + r.stderr
    assert "the model's own print" in r.stdout
    assert "def forward(self" not in r.stderr and "Unable to find user code" not in r.stderr, r.stderr[:2000]
