"""conveyor.Module misused: every bad argument is a ConveyorValueError naming the argument and
what to give, raised in the constructor before any work (no torch error from deep inside the
first step, no silent acceptance)."""
import copy
import struct
import zlib

import pytest
import torch

import conveyor
import zoo
from conveyor.errors import ConveyorValueError, GraphFormatError


@pytest.fixture
def case():
    torch.manual_seed(0)
    return zoo.mlp(batch=8)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("arguments, message", [
    (dict(microbatches=0), "microbatches=0: expected a whole number, at least 1"),
    (dict(microbatches=2.5), "microbatches=2.5"),
    (dict(devices=1, stages=2), "stages=2 needs 2 devices"),
    (dict(devices=1.5), "devices=1.5: expected a whole number"),
    (dict(stages=0), "stages=0: expected a number of stages"),
    (dict(stages="2"), "stages='2'"),
    (dict(timeout="abc"), "timeout='abc': expected a number of seconds from 0.001 to 604800"),
    (dict(timeout=1e300), "timeout=1e+300"),
    (dict(timeout=float("nan")), "timeout=nan"),
    (dict(timeout=0), "timeout=0"),
    (dict(cluster="/nonexistent.toml"), "cluster='/nonexistent.toml': no such file"),
    (dict(trace="/nonexistent/dir/t.pftrace"), "the folder /nonexistent/dir does not exist"),
    (dict(plan="/"), "plan='/': no such file"),
    (dict(loss_fn=3), "loss_fn=3: expected a function"),
    (dict(schedule="fast"), "unknown schedule 'fast'"),
    (dict(replicas=0), "replicas=0"),
    (dict(recompute="yes"), "recompute='yes'"),
    (dict(transport="tcp"), "transport='tcp'"),
    (dict(replan="sometimes"), "replan='sometimes'"),
    (dict(replan=False), "replan=False"), (dict(replan=""), "replan=''"), (dict(replan=0), "replan=0"),
    (dict(replan_horizon=0), "replan_horizon=0"),
])
def test_bad_arguments_are_refused_in_the_constructor(case, arguments, message):
    with pytest.raises(ConveyorValueError, match=None) as e:
        conveyor.Module(case.model, sgd(case.model), **arguments)
    assert message in str(e.value)


def test_what_is_not_a_trainable_model(case):
    with pytest.raises(ConveyorValueError, match="takes a torch.nn.Module, not function"):
        conveyor.Module(lambda x: x * 2, None)
    with pytest.raises(ConveyorValueError, match=r"the model \(ReLU\) has no parameters"):
        conveyor.Module(torch.nn.ReLU(), None)
    with pytest.raises(ConveyorValueError, match="the optimizer holds none of the model's parameters"):
        conveyor.Module(case.model, sgd(torch.nn.Linear(2, 2)))
    with pytest.raises(ConveyorValueError, match="expected a torch.optim.Optimizer"):
        conveyor.Module(case.model, "adam")


def test_bad_timeout_in_the_environment(case, monkeypatch):
    monkeypatch.setenv("CONVEYOR_TIMEOUT", "1e300")
    with pytest.raises(ConveyorValueError, match="CONVEYOR_TIMEOUT=1e.300: expected a number of seconds"):
        conveyor.Module(case.model, sgd(case.model))


def test_plan_files_are_read_by_the_planner_s_own_checks(case, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b'{"format": "\xff\xfe", "version": 1}')
    with pytest.raises(ConveyorValueError, match=r"not a conveyor plan document.*not valid JSON.*UTF-8"):
        conveyor.Module(case.model, sgd(case.model), plan=bad)(*case.args)


def test_graph_files_whose_document_is_not_utf8_raise_conveyor_errors(case, tmp_path):
    """A crafted graph file (checksums recomputed) with bytes that are not UTF-8 in its
    document: a GraphFormatError with a readable message, not a UnicodeDecodeError."""
    path = tmp_path / "mlp.cvg"
    conveyor.capture(case.model, case.args, case.kwargs).save(path, weights=False)
    data = path.read_bytes()
    text_size = struct.unpack_from("<Q", data, 16)[0]
    text = data[40:40 + text_size].replace(b'"conveyor.graph"', b'"conveyor\xff\xfegraph"')
    rest = data[(40 + text_size + 63) // 64 * 64:]
    header = data[:16] + struct.pack("<QQII", len(text), len(rest), zlib.crc32(text), zlib.crc32(rest))
    crafted = header + text + b"\0" * ((40 + len(text) + 63) // 64 * 64 - 40 - len(text)) + rest
    path.write_bytes(crafted)
    with pytest.raises(GraphFormatError, match="not valid JSON") as e:
        conveyor.Graph.load(path)
    assert "\ufffd" not in str(e.value) and len(str(e.value)) < 1000


def test_microbatches_that_do_not_divide_the_batch_train_exactly(case):
    """microbatches=3 for a batch of 8 is not misuse: microbatches of 3, 3 and 2 samples,
    each loss weighted by its size, give the gradients of the whole batch."""
    torch.manual_seed(0)
    case = zoo.mlp(batch=8)
    reference = copy.deepcopy(case.model)
    case.loss(reference(*case.args, **case.kwargs)).backward()
    model = conveyor.Module(case.model, None, stages=2, microbatches=3, replan="off")
    case.loss(model(*case.args, **case.kwargs)).backward()
    for (name, p), q in zip(case.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_files_that_cannot_be_read_are_conveyor_errors(tmp_path):
    """Still OSErrors (code catching those keeps working), and ConveyorErrors."""
    for path, message in ((tmp_path / "missing.cvg", "cannot open graph file"), (tmp_path, "is a directory")):
        with pytest.raises(conveyor.ConveyorIOError, match=message) as e:
            conveyor.Graph.load(path)
        assert isinstance(e.value, OSError) and isinstance(e.value, conveyor.ConveyorError)
