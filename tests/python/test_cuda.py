"""The executor on CUDA: the same exactness as on the CPU (needs a GPU; skipped without)."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import conveyor
import zoo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")

HERE = os.path.dirname(os.path.abspath(__file__))  # where zoo.py is: a script run with -c imports it from its cwd
CASES = ["mlp", "cnn_batchnorm", "resnet18", "gpt2", "t5", "unet3d", "inplace"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_stages", [1, 3])
def test_cuda_matches_eager(name, num_stages, rel_err):
    torch.manual_seed(0)
    case = zoo.CASES[name]()
    model = case.model.cuda()
    args = tuple(a.cuda() for a in case.args)
    kwargs = {k: v.cuda() for k, v in case.kwargs.items()}
    ref = copy.deepcopy(model)
    graph = conveyor.capture(model, args, kwargs)
    run = graph if num_stages == 1 else graph.split(num_stages, random_cut=True, seed=1)
    loss = case.loss(run(*args, **kwargs))
    loss.backward()
    ref_loss = case.loss(ref(*args, **kwargs))
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-9
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            # With a floor: a gradient that is zero in exact arithmetic (a convolution's bias
            # before BatchNorm) is rounding noise, whose order differs between cuDNN's kernels.
            err = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), 1e-6)
            assert err <= 1e-9, f"{n} differs by {err:.2e}"
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert rel_err(b, c) <= 1e-9, n


def test_a_pipelined_step_makes_the_host_wait_for_the_device_once():
    """docs/thread_model.md: the host waits for the device once per step, whatever the
    replicas do (redistribution, bucketed sums during backward): conveyor's own device
    synchronizations count one a step, and torch's sync debug mode, which reports every other
    synchronizing CUDA call (an item(), a blocking copy, a stream synchronize) on any thread,
    reports none (the device synchronize through c10's guard is not among those it reports).
    In a process of its own, so the debug mode reaches no other test."""
    script = textwrap.dedent("""
        import torch, conveyor
        import zoo
        from conveyor import _C

        torch.manual_seed(0)
        case = zoo.mlp(batch=16)  # returns its loss
        model = case.model.cuda()
        args = tuple(a.cuda() for a in case.args)
        graph = conveyor.capture(model, args)
        step = _C.PipelineStep(graph.executor, graph.random_partition(2, seed=0), "1f1b", 4, 1, [2, 1],
                               bucket_bytes=64)
        inputs = graph.flatten_inputs(args, {})
        for _ in range(2):
            step.run(inputs)  # warm-up: the allocator, the streams' event pools
        torch.cuda.synchronize()
        before = _C.host_waits()
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(3):
            step.run(inputs)
        torch.cuda.set_sync_debug_mode(0)
        print("HOST_WAITS", _C.host_waits() - before, "REDUCED_EARLY", step.last_reduction()[1])
    """)
    env = dict(os.environ, PYTHONWARNINGS="always")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("HOST_WAITS"))
    words = line.split()
    assert int(words[1]) == 3, line
    assert int(words[3]) > 0, "the replicated stage's buckets were summed during backward"
    synchronizing = done.stderr.count("called a synchronizing CUDA operation")
    assert synchronizing == 0, f"{synchronizing} other synchronizing CUDA calls in 3 steps:\n{done.stderr[-3000:]}"


def test_ranks_reading_a_tied_weight_never_accumulate_across_streams():
    """GPT-2's tied embedding, read by the first and the last of 3 ranks of one process (each
    on its own thread and compute stream): each rank accumulates into a leaf of its own, so
    autograd never adds a gradient made on one stream into an accumulator of another (torch
    warns when it does: it then orders the streams behind each other), and the parameter's
    gradient is still the sum over the stages, as in eager. In a process of its own, since
    torch warns once per process, from a C++ thread, on stderr."""
    script = textwrap.dedent("""
        import copy, torch, conveyor
        import zoo
        from conveyor import _C
        from conveyor.loss_wrapper import loss_wrapper

        torch.manual_seed(0)
        case = zoo.gpt2(batch=8, seq=16, dtype=torch.float64, layers=2, hidden=32, vocab=64)
        model = case.model.cuda()
        kwargs = {k: v.cuda() for k, v in case.kwargs.items()}
        ref = copy.deepcopy(model)
        graph = conveyor.capture(loss_wrapper(model, case.loss, (), kwargs), (), kwargs)
        stages = graph.random_partition(3, seed=0, keep_node_order=True)
        tied = next(b["value"] for b in graph.document["bindings"] if b["name"].endswith(("wte.weight", "lm_head.weight")))
        print("READERS", *[s for s, nodes in enumerate(stages)
                           if any(a.get("value") == tied for n in nodes for a in graph.nodes[n]["args"])])
        step = _C.PipelineStep(graph.executor, stages, "1f1b", 4, 1, [1, 1, 1])
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step.run(graph.flatten_inputs((), kwargs))
        case.loss(ref(**kwargs)).backward()
        worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
                    for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
        print("WORST", worst)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AccumulateGrad node's stream does not match" not in done.stderr, done.stderr[-3000:]
    readers = next(l for l in done.stdout.splitlines() if l.startswith("READERS")).split()[1:]
    assert len(readers) == 2, f"the tied weight is read by stages {readers}: the test needs two ranks to read it"
    worst = float(next(l for l in done.stdout.splitlines() if l.startswith("WORST")).split()[1])
    assert worst <= 1e-9
