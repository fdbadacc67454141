"""Bad input gets a clear error naming what is wrong and what to do."""
import inspect
import json
import os
import re

import pytest
import torch
import torch.nn as nn

import conveyor
import zoo


def line_of(function, text: str) -> int:
    """The line of this file where `function`'s source holds `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(k for k, line in enumerate(lines) if text in line)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # branches on a tensor's value
            return h.relu().sum()
        return h.sum()


class UsesCond(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,)).sum()


class ReturnsText(nn.Module):
    def forward(self, x):
        return x.sum(), "done"


def test_data_dependent_control_flow_names_the_line():
    x = torch.randn(4, 4)
    with pytest.raises(conveyor.CaptureError) as info:
        conveyor.capture(DataDependent(), (x,))
    msg = str(info.value)
    assert "DataDependent" in msg
    assert f"test_errors.py:{line_of(DataDependent.forward, 'if h.sum()')}" in msg, msg  # the `if` line
    assert "if h.sum() > 0" in msg
    assert "data-dependent" in msg


def test_unsupported_higher_order_op_is_named():
    with pytest.raises(conveyor.CaptureError) as info:
        conveyor.capture(UsesCond(), (torch.randn(4, 3),))
    msg = str(info.value)
    assert "cond" in msg, msg
    assert f"test_errors.py:{line_of(UsesCond.forward, 'torch.cond')}" in msg, msg
    assert "torch.where" in msg


def test_non_tensor_outputs_are_refused():
    with pytest.raises(conveyor.CaptureError) as info:
        conveyor.capture(ReturnsText(), (torch.randn(4, 3),))
    assert "return tensors only" in str(info.value) or "done" in str(info.value)


def test_cache_objects_get_a_hint():
    torch.manual_seed(0)
    case = zoo.gpt2()
    case.model.config.use_cache = True
    with pytest.raises(conveyor.CaptureError) as info:
        conveyor.capture(case.model, case.args, {"input_ids": case.kwargs["input_ids"], "use_cache": True})
    assert "use_cache=False" in str(info.value)


def test_capture_needs_a_module_and_a_batch_of_two():
    with pytest.raises(conveyor.CaptureError, match="torch.nn.Module"):
        conveyor.capture(lambda x: x, (torch.randn(2, 2),))
    with pytest.raises(conveyor.CaptureError, match="at least 2"):
        conveyor.capture(nn.Linear(3, 3), (torch.randn(1, 3),))
    with pytest.raises(conveyor.CaptureError, match="no tensor inputs"):
        conveyor.capture(nn.Identity(), ())


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    case = zoo.mlp()
    graph = conveyor.capture(case.model, case.args)
    path = tmp_path / "mlp.cvg"
    graph.save(path)
    return case, graph, path


def test_save_load_round_trip_with_and_without_model(saved, tmp_path):
    case, graph, path = saved
    bound = conveyor.Graph.load(path, model=case.model)
    assert bound.tensors["layers.0.weight"] is case.model.layers[0].weight
    assert torch.equal(bound(*case.args), case.model(*case.args))
    standalone = conveyor.Graph.load(path)
    assert standalone.tensors["layers.0.weight"] is not case.model.layers[0].weight
    assert torch.equal(standalone(*case.args), case.model(*case.args))
    no_weights = tmp_path / "structure.cvg"
    graph.save(no_weights, weights=False)
    assert os.path.getsize(no_weights) < os.path.getsize(path)
    with pytest.raises(conveyor.GraphFormatError, match="saved without weights"):
        conveyor.Graph.load(no_weights)
    assert torch.equal(conveyor.Graph.load(no_weights, model=case.model)(*case.args), case.model(*case.args))


def test_truncated_and_corrupted_files(saved):
    _, _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(conveyor.GraphCorruptError, match="truncated"):
        conveyor.Graph.load(path)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(conveyor.GraphCorruptError, match="checksum"):
        conveyor.Graph.load(path)
    path.write_bytes(b"not a graph at all")
    with pytest.raises(conveyor.GraphFormatError, match="not a conveyor graph file"):
        conveyor.Graph.load(path)
    with pytest.raises(OSError, match="cannot open"):
        conveyor.Graph.load(str(path) + ".missing")


def test_newer_format_version(saved, tmp_path):
    _, graph, _ = saved
    doc = graph.document
    doc["version"] = 99
    with pytest.raises(conveyor.GraphVersionError, match="format version 99"):
        conveyor._C.GraphIR(json.dumps(doc))


def test_unknown_op_is_named(saved, tmp_path):
    case, graph, _ = saved
    doc = json.loads(json.dumps(graph.document))
    doc["nodes"][1]["op"] = "aten::gelu_v2"
    doc["producer"]["torch"] = "3.0.0"
    path = tmp_path / "future.cvg"
    conveyor._C.save_graph_file(str(path), conveyor._C.GraphIR(json.dumps(doc)), [])
    loaded = conveyor.Graph.load(path, model=case.model)
    with pytest.raises(conveyor.UnknownOpError) as info:
        loaded(*case.args)
    assert "aten::gelu_v2" in str(info.value) and "captured with torch 3.0.0" in str(info.value)


def test_crafted_extras_and_weights_raise_conveyor_errors_at_load(saved, tmp_path):
    """A .cvg whose mapping of a call to the graph ("extra") or whose weights were crafted:
    each is a GraphFormatError naming the file at load, not torch's RuntimeError, an
    AttributeError or a TypeError at the first call."""
    case, graph, _ = saved
    path = tmp_path / "crafted.cvg"

    def crafted(extra=None, weights=None):
        doc = json.loads(json.dumps(graph.document))
        if extra is not None:
            doc["extra"] = extra
        conveyor._C.save_graph_file(str(path), conveyor._C.GraphIR(json.dumps(doc)),
                                    weights if weights is not None else list(graph.tensors.items()))
        return path

    good = graph.document["extra"]
    for extra, says in [([1], "is list, not a table"),
                        (dict(good, input_positions=5), "input_positions is 5"),
                        (dict(good, input_positions="ab"), "input_positions is 'ab'"),
                        (dict(good, input_positions=[0, 1, 2]), "names 3 arguments for 2 graph inputs"),
                        (dict(good, out_spec='[1, {"type": "builtins.tuple", "context": "null", "children_spec": ['
                                             '{"type": null, "context": null, "children_spec": []}, '
                                             '{"type": null, "context": null, "children_spec": []}]}]'),
                         "out_spec has 2 leaves for 1 graph outputs"),
                        (dict(good, in_spec="not a spec"), "in_spec does not read"),
                        (dict(good, dynamic_batch="yes"), "dynamic_batch")]:
        with pytest.raises(conveyor.GraphFormatError, match=re.escape(says)):
            conveyor.Graph.load(crafted(extra))
    for dtype in (torch.int32, torch.bool):
        weights = [(n, t.to(dtype) if n == "layers.0.weight" else t) for n, t in graph.tensors.items()]
        with pytest.raises(conveyor.GraphFormatError, match=f"parameter 'layers.0.weight' as {dtype}"):
            conveyor.Graph.load(crafted(weights=weights))
    assert torch.equal(conveyor.Graph.load(crafted(good))(*case.args), case.model(*case.args))


def test_malformed_documents(saved):
    _, graph, _ = saved
    doc = json.loads(json.dumps(graph.document))
    doc["nodes"][2]["args"][0] = {"value": 10_000}
    with pytest.raises(conveyor.InvalidGraphError, match="does not exist"):
        conveyor._C.GraphIR(json.dumps(doc))
    doc = json.loads(json.dumps(graph.document))
    del doc["nodes"][0]["returns"]
    with pytest.raises(conveyor.GraphFormatError, match="/nodes/0.*returns"):
        conveyor._C.GraphIR(json.dumps(doc))


def test_bad_stage_cuts(saved):
    _, graph, _ = saved
    n = graph.num_nodes
    with pytest.raises(conveyor.InvalidStageError, match="in no stage"):
        graph.split([[0], [1]])
    with pytest.raises(conveyor.InvalidStageError, match="data flows forward"):
        graph.split([list(range(1, n)), [0]])
    with pytest.raises(conveyor.ConveyorValueError, match="units that can be separated"):
        graph.split(n + 1, random_cut=True)
    with pytest.raises(conveyor.ConveyorValueError, match=r"split\(2\): a count of stages is a random cut, for "
                                                          r"testing; pass split\(2, random_cut=True, seed=0\)"):
        graph.split(2)
    with pytest.raises(conveyor.ConveyorValueError, match="pass the count"):
        graph.split([list(range(n))], random_cut=True)


def test_wrong_inputs_and_runtime_failures(saved):
    case, graph, _ = saved
    x, target = case.args
    with pytest.raises(conveyor.ConveyorValueError, match="captured with 2 positional arguments; this call passes 1"):
        graph(x)
    with pytest.raises(conveyor.ConveyorValueError,
                       match=r"input 0 \('x'\) has shape \[8, 5\] but the graph was captured for \[s\w+, 16\]"):
        graph(torch.randn(8, 5, dtype=torch.float64), target)
    with pytest.raises(conveyor.ConveyorValueError, match="has dtype float32 but the graph was captured with float64"):
        graph(x.float(), target)
    with pytest.raises(conveyor.ConveyorValueError, match="inputs 0 and 1 disagree on batch .*: 8 and 6"):
        graph(x, target[:6])
    # Right shapes and dtypes, wrong values: the failing operator and its source line.
    torch.manual_seed(0)
    cnn = zoo.cnn_batchnorm()
    cnn_graph = conveyor.capture(cnn.model, cnn.args)
    with pytest.raises(conveyor.ExecutionError) as info:
        cnn_graph(cnn.args[0], torch.full_like(cnn.args[1], 99))  # 5 classes
    assert "cross_entropy" in str(info.value) or "nll_loss" in str(info.value), str(info.value)
    assert "zoo.py" in str(info.value), str(info.value)


def test_binding_to_the_wrong_model(saved):
    _, _, path = saved
    with pytest.raises(conveyor.ConveyorValueError, match="no such parameter"):
        conveyor.Graph.load(path, model=nn.Linear(3, 3))
    other = zoo.MLP(sizes=(16, 32, 8, 4)).double()
    with pytest.raises(conveyor.ConveyorValueError, match="has shape"):
        conveyor.Graph.load(path, model=other)(*saved[0].args)
