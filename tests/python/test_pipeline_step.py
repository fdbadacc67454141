"""A pipelined step in one process (C++ runner threads bound to stage programs) trains
exactly like eager PyTorch with gradient accumulation over the same microbatches.

For the deterministic zoo (float64): 3 SGD steps with stages in {2, 3, 4}, replicas in
{1, 2}, microbatches in {1, 4, 8} (keeping two samples per share for BatchNorm) and the
schedules GPipe, 1F1B, ZB-H1 (split backward), interleaved, ZB-V and DualPipeV (2 chunks per rank) leave
every parameter (and, with one replica, every buffer) within a relative 1e-9 of eager.
Every configuration of that product runs on at least one model of the zoo, and every model
runs each schedule with each stage count and each replica count (`covering`).
"""
import copy
import dataclasses
import itertools
import json

import pytest
import torch

import conveyor
import zoo
from conveyor import _C
from conveyor.loss_wrapper import loss_wrapper

from conftest import split_batch

TOLERANCE = 1e-9
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def on_device(case, device):
    """The zoo case with its model and tensors on `device`."""
    if device == "cpu":
        return case
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return dataclasses.replace(case, model=case.model.to(device), args=tuple(move(a) for a in case.args),
                               kwargs={k: move(v) for k, v in case.kwargs.items()})


@pytest.fixture
def deterministic_cuda():
    """cuDNN and scatter kernels without atomics, so the eager reference and the pipelined
    run round alike (BatchNorm over two samples amplifies any difference)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[0], saved[1]
    torch.use_deterministic_algorithms(saved[2])


def loss_only(case):
    """The model with its loss as the only output, as conveyor.Module wraps it."""
    return loss_wrapper(case.model, case.loss, case.args, case.kwargs)


def captured(case):
    """(loss-only model, its initial state, the captured graph, flattened inputs); capture
    runs the model once, so its state is put back afterwards."""
    wrapped = loss_only(case)
    initial = copy.deepcopy(wrapped.state_dict())
    graph = conveyor.capture(wrapped, case.args, case.kwargs)
    wrapped.load_state_dict(initial)
    if "batch" not in graph.document["symbols"].values():
        device = next(wrapped.parameters()).device
        pytest.skip(f"{case.name} on {device} was captured with a fixed batch (torch.export specialized it; "
                    "conveyor warned), so it cannot be cut into microbatches")
    return wrapped, initial, graph, graph.flatten_inputs(case.args, case.kwargs)


def batch_size(case):
    for x in list(case.args) + list(case.kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    raise AssertionError("no batch")


CASES = [name for name, make in zoo.CASES.items() if name != "dropout"]
# Batch per model: large enough for 8 microbatches of 2 replicas where it is cheap.
BATCH = {"resnet18": 8, "unet3d": 8}


def pipelined_grads_then_eager(wrapped, case, parts, batch):
    """The pipelined step's gradients (copied), then the model's own gradients and loss from
    eager accumulation over `parts` equal parts of the batch, each weighted 1 / parts as the
    runtime weights a share (a multiplication: in float32, x / 6 and x * (1 / 6) differ)."""
    got = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.grad is not None}
    wrapped.zero_grad(set_to_none=True)
    ref_loss = 0
    for a, k in split_batch(case.args, case.kwargs, parts, batch):
        part = wrapped(*a, **k) * (1.0 / parts)
        part.backward()
        ref_loss = ref_loss + part.detach()
    return got, ref_loss


def stage_returning_the_loss(graph, partition) -> int:
    """The stage of `partition` whose node returns the graph's output (the loss)."""
    out = graph.document["outputs"][0]
    node = next(n["id"] for n in graph.document["nodes"] if any(r.get("value") == out for r in n["returns"]))
    return next(s for s, nodes in enumerate(partition) if node in nodes)


def has_batchnorm(model):
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def configs(batch, batchnorm):
    """(schedule, stages, chunks, replicas, microbatches): stages in {2, 3, 4}, replicas in
    {1, 2}, microbatches in {1, 4, 8}, every schedule (interleaved, ZB-V and DualPipeV: 2
    chunks per rank; ZB-V's and DualPipeV's ranks hold stages in a V, so their middle stages
    share the last rank). A
    BatchNorm model needs two samples in every share, so its larger splits are left out."""
    out = []
    for stages in (2, 3, 4):
        for replicas in (1, 2):
            for m in (1, 4, 8):
                if batch // m < replicas * (2 if batchnorm else 1):
                    continue
                for schedule in ("gpipe", "1f1b", "zb-h1"):
                    out.append((schedule, stages, 1, replicas, m))
                if stages % 2 == 0 and m % (stages // 2) == 0:
                    out.append(("interleaved", stages, 2, replicas, m))
                if stages % 2 == 0:
                    out.append(("zb-v", stages, 2, replicas, m))
                if stages % 2 == 0 and m >= stages:  # DualPipeV: a microbatch per stage at least
                    out.append(("dualpipev", stages, 2, replicas, m))
    return out


BATCHNORM = {"cnn_batchnorm", "resnet18", "unet3d"}  # checked against the model when it runs


def allowed_configs(name: str) -> list:
    """The configurations of the product that `name`'s batch allows."""
    return configs(BATCH.get(name, 16), name in BATCHNORM)


def covering(name: str) -> list:
    """The configurations `name` runs: a share of the product, so that the product runs
    whole across the zoo (each configuration given to one of the models that allow it, in
    turn), and each model then takes, in its own rotated order, what it still lacks of every
    schedule with each stage count and each replica count, and of every microbatch count:
    about a quarter of the 651 runs of the whole product on every model."""
    allowed = {n: allowed_configs(n) for n in CASES}
    every = list(dict.fromkeys(c for n in CASES for c in allowed[n]))
    owner = {}
    for i, c in enumerate(every):
        able = [n for n in CASES if c in allowed[n]]
        owner[c] = able[i % len(able)]

    def settings(config):
        schedule, stages, _, replicas, m = config
        return {("stages", stages), ("replicas", replicas), ("microbatches", m),
                ("schedule, stages", schedule, stages), ("schedule, replicas", schedule, replicas)}
    mine = [c for c in allowed[name] if owner[c] == name]
    seen = set(itertools.chain.from_iterable(settings(c) for c in mine))
    turn = CASES.index(name) % len(allowed[name])
    for c in allowed[name][turn:] + allowed[name][:turn]:
        if c not in mine and settings(c) - seen:
            mine.append(c)
            seen |= settings(c)
    return mine


def test_the_zoo_together_runs_every_configuration_of_the_product():
    ran = {c for n in CASES for c in covering(n)}
    assert ran == {c for n in CASES for c in allowed_configs(n)}
    for n in CASES:
        schedules = {c[0] for c in allowed_configs(n)}
        assert {c[0] for c in covering(n)} == schedules, n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_pipelined_steps_equal_eager_gradient_accumulation(name, device, rel_err, deterministic_cuda):
    """On CUDA every replica runs on its own compute, send and recv streams, ordered by
    events: the same results show that no stream reads what another has not finished."""
    torch.manual_seed(0)
    case = on_device(zoo.CASES[name](batch=BATCH.get(name, 16)), device)
    batch = batch_size(case)
    wrapped, initial, graph, inputs = captured(case)
    assert has_batchnorm(wrapped) == (name in BATCHNORM), f"{name}: BATCHNORM is out of date"
    assert batch == BATCH.get(name, 16)
    tried = 0
    for schedule, stages, chunks, replicas, m in covering(name):
        partition = graph.random_partition(stages, seed=stages * 10 + m, keep_node_order=False)
        # The reference's intra-op threads in every replica: float64 kernels round by thread
        # count, and BatchNorm over two samples amplifies 1e-15 into 1e-7 within 3 steps.
        step = _C.PipelineStep(graph.executor, partition, schedule, m, chunks, [replicas] * (stages // chunks),
                               0, torch.get_num_threads())
        ref = copy.deepcopy(wrapped)
        wrapped.load_state_dict(initial)
        ref.load_state_dict(initial)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        what = f"{name} {schedule} stages={stages} replicas={replicas} m={m}"
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss, seconds, actions = step.run(inputs)
            opt.step()
            # Eager: gradient accumulation over the same shares (each microbatch split
            # between the replicas), each weighted by its part of the batch (1 for a sum).
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = 0
            tokens = case.counted_tokens(case.kwargs)  # a padded causal LM's: the whole call's count
            for a, k in split_batch(case.args, case.kwargs, m, batch):
                for a2, k2 in split_batch(a, k, replicas, batch_size(zoo.ZooCase(name, None, a, k))):
                    rows = batch_size(zoo.ZooCase(name, None, a2, k2))
                    part = (case.share_loss(ref.model, a2, k2, rows, batch, tokens) if tokens is not None else
                            ref(*a2, **k2) * case.share_weight(rows, batch))
                    part.backward()
                    ref_loss = ref_loss + part.detach()
            ref_opt.step()
            assert rel_err(loss, ref_loss) <= TOLERANCE, f"{what}: loss {loss.item()} vs {ref_loss.item()}"
            assert actions > 0 and seconds > 0
        for (n, p), (_, q) in zip(wrapped.named_parameters(), ref.named_parameters()):
            # Relative to the parameter, with a floor: a gradient that is zero in exact
            # arithmetic (BERT's key bias under softmax) leaves rounding noise near 1e-23.
            err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-6)
            assert err <= TOLERANCE, f"{what}: parameter {n} differs by {err:.2e}"
        if replicas == 1:  # with replicas, running statistics follow replica 0's shares (docs/design.md)
            for (n, b), (_, c) in zip(wrapped.named_buffers(), ref.named_buffers()):
                assert torch.equal(b, c) or rel_err(b, c) <= TOLERANCE, f"{what}: buffer {n} differs"
        tried += 1
    assert tried >= 18, f"{name}: only {tried} configurations ran"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert", "t5"])
def test_stages_with_different_replica_counts_redistribute(name, device, rel_err, deterministic_cuda):
    """Replica counts 2, 1, 3: activations are joined and re-split along their batch
    dimension between stages (and gradients back), still equal to eager accumulation. On
    CUDA the joins run on the consumer's recv stream, the gradients back on its send stream."""
    torch.manual_seed(0)
    case = on_device(zoo.CASES[name](batch=12), device)
    wrapped, initial, graph, inputs = captured(case)
    ran, counts = 0, [2, 1, 3]
    # Random cuts often pass a value that cannot be redistributed (no batch dimension, or
    # positions within a share such as an attention mask's arange(batch)); those are refused.
    for seed in range(32):
        if ran >= 4:
            break
        for schedule in ("1f1b", "zb-h1"):
            partition = graph.random_partition(3, seed=seed)
            try:
                step = _C.PipelineStep(graph.executor, partition, schedule, 2, 1, counts)
            except conveyor.UnsupportedError as e:
                assert "same number of replicas" in str(e)
                continue
            wrapped.load_state_dict(initial)
            wrapped.zero_grad(set_to_none=True)
            loss, _, _ = step.run(inputs)
            # Eager over the shares the loss is computed on (2 microbatches, each split among
            # the replicas of the stage that returns the loss, into equal parts of 12): GPT-2's
            # loss runs in float32 even in a float64 model (transformers' loss casts the
            # logits with .float()), and on CUDA float32 sums round in float32 (the CPU's in
            # double), so one loss over 6 samples and three over 2 differ there by 1e-7.
            parts = 2 * counts[stage_returning_the_loss(graph, partition)]
            got, ref_loss = pipelined_grads_then_eager(wrapped, case, parts, 12)
            assert rel_err(loss, ref_loss) <= TOLERANCE
            for n, p in wrapped.named_parameters():
                if p.grad is None:
                    continue
                err = (got[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-6)
                assert err <= TOLERANCE, f"{name} {schedule} seed {seed}: {n} differs by {err:.2e}"
            ran += 1
    assert ran >= 4, f"{name}: only {ran} partitions could run with different replica counts"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mlp", "gpt2", "bert"])
def test_buckets_are_reduced_while_backward_runs(name, device, rel_err, tmp_path, deterministic_cuda):
    """Replicated stages reduce each gradient bucket as soon as every replica's last
    backward has accumulated it (tiny buckets: one parameter each), not after the backward;
    the result still equals eager accumulation, and a hook the user registered on a
    parameter keeps firing (conveyor chains its own hook after it)."""
    torch.manual_seed(0)
    case = on_device(zoo.CASES[name](batch=8), device)
    wrapped, initial, graph, inputs = captured(case)
    first = next(p for p in wrapped.parameters())
    fired = []
    handle = first.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    try:
        for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2)):
            step = _C.PipelineStep(graph.executor, graph.random_partition(4, seed=1), schedule, 2, chunks,
                                   [2] * (4 // chunks), bucket_bytes=1, intra_op_threads=torch.get_num_threads())
            wrapped.load_state_dict(initial)
            wrapped.zero_grad(set_to_none=True)
            fired.clear()
            loss, _, _ = step.run(inputs)
            buckets, early = step.last_reduction()
            assert buckets >= len(list(wrapped.parameters())) - 1 and 0 < early <= buckets, (schedule, buckets, early)
            assert fired, "the user's hook on a parameter stopped firing"
            # The trace shows them: each early bucket on both replicas' collective tracks, beside
            # every stage's allreduce (whether one starts before the backward ends is up to
            # the OS scheduler on a busy machine, so only their presence is checked).
            step.write_trace(str(tmp_path / "step.json"))
            events = [e for e in json.loads((tmp_path / "step.json").read_text())["traceEvents"] if e["ph"] == "X"]
            reductions = [e for e in events if e["name"].startswith("allreduce")]
            assert len(reductions) == 4 * 2 + early * 2, (schedule, len(reductions), early)
            got, ref_loss = pipelined_grads_then_eager(wrapped, case, 4, 8)  # 2 microbatches x 2 replicas
            assert rel_err(loss, ref_loss) <= TOLERANCE
            for n, p in wrapped.named_parameters():
                if p.grad is not None:
                    assert rel_err(got[n], p.grad) <= TOLERANCE, f"{name} {schedule}: {n}"
    finally:
        handle.remove()


class SharedLayers(torch.nn.Module):
    """One layer applied three times (ALBERT-style weight reuse): a parameter reached along
    several paths of one stage, the case a split backward could count twice."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.shared(h)) + h
        return torch.nn.functional.mse_loss(self.out(h), y)


def test_split_backward_counts_reused_weights_once(rel_err):
    torch.manual_seed(0)
    model = SharedLayers().double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    graph = conveyor.capture(model, (x, y))
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for seed in range(6):
        for stages in (2, 3):
            parts = graph.random_partition(stages, seed=seed)
            model.zero_grad(set_to_none=True)
            _C.PipelineStep(graph.executor, parts, "zb-h1", 4).run(graph.flatten_inputs((x, y), {}))
            for n, p in model.named_parameters():
                assert rel_err(p.grad, expected[n]) <= TOLERANCE, f"{n} (seed {seed}, {stages} stages)"


def test_bad_pipelined_inputs_get_clear_errors():
    torch.manual_seed(0)
    case = zoo.mlp(batch=3)
    wrapped = loss_only(case)
    graph = conveyor.capture(wrapped, case.args)
    parts = graph.random_partition(2, seed=0)
    step = _C.PipelineStep(graph.executor, parts, "1f1b", 4)
    with pytest.raises(conveyor.ConveyorValueError, match="fewer than the 4 microbatches"):
        step.run(graph.flatten_inputs(case.args, {}))
    replicated = _C.PipelineStep(graph.executor, parts, "1f1b", 2, 1, [2, 2])
    with pytest.raises(conveyor.ConveyorValueError, match="fewer than the 2 replicas"):
        replicated.run(graph.flatten_inputs(case.args, {}))
    with pytest.raises(conveyor.ConveyorValueError, match="at least one replica"):
        _C.PipelineStep(graph.executor, parts, "1f1b", 2, 1, [1, 0])
    # A plan for another pipeline is no reference for this one's live profile.
    prof = conveyor.profile(graph, case.args, cache=False)
    cluster = 'name = "c"\n[[node]]\ndevices = 2\nmemory = "1 GiB"\n[link.intra_node]\nbandwidth = "1 GB/s"\n'
    plan = conveyor.plan(graph, prof, cluster, batch=3, microbatches=3, schedules=["gpipe"], max_replicas=1)
    with pytest.raises(conveyor.ConveyorValueError, match="describes a different pipeline"):
        _C.PipelineStep(graph.executor, parts, "1f1b", 2, plan=plan.handle)
    with pytest.raises(TypeError):  # a plan crosses as a _C.Plan, never as its document's text
        _C.PipelineStep(graph.executor, parts, "1f1b", 2, plan=json.dumps(plan.document))
    linear = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    raw = conveyor.capture(linear, (case.args[0],))  # returns outputs, not a loss
    with pytest.raises(conveyor.ConveyorValueError, match="one scalar loss"):
        _C.PipelineStep(raw.executor, raw.random_partition(2, seed=0), "1f1b", 1)


@CUDA
@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2)])
def test_cuda_streams_run_each_replica_in_order_and_are_timed_on_the_device(schedule, chunks, rel_err,
                                                                            deterministic_cuda):
    """Each replica's actions run on its own compute stream: the device times read from
    their events never overlap on one stream and follow the replica's list; the step's
    reductions run on the collective streams within the step; results equal eager."""
    torch.manual_seed(0)
    case = on_device(zoo.gpt2(batch=8), "cuda")
    wrapped, initial, graph, inputs = captured(case)
    step = _C.PipelineStep(graph.executor, graph.random_partition(4, seed=2), schedule, 2, chunks,
                           [2] * (4 // chunks), bucket_bytes=1)
    for _ in range(2):  # the second step reuses the first one's events
        wrapped.load_state_dict(initial)
        wrapped.zero_grad(set_to_none=True)
        loss, seconds, _ = step.run(inputs)
    spans = step.spans()
    compute = [s for s in spans if s["stream"] == "compute" and s["microbatch"] >= 0]  # F, B, Bi, W
    assert len(compute) == 2 * 2 * 4 * (3 if schedule.startswith("zb") else 2), len(compute)
    for rank in range(4 // chunks):
        for replica in range(2):
            mine = [s for s in compute if s["rank"] == rank and s["replica"] == replica]
            for a, b in zip(mine, mine[1:]):
                assert a["start_s"] <= a["end_s"] <= b["start_s"] + 1e-6, (a, b)
    for s in spans:
        assert -1e-3 <= s["start_s"] <= s["end_s"] <= seconds + 1e-3, (s, seconds)
    buckets, early = step.last_reduction()
    assert 0 < early <= buckets
    got, ref_loss = pipelined_grads_then_eager(wrapped, case, 4, 8)
    assert rel_err(loss, ref_loss) <= TOLERANCE
    for n, p in wrapped.named_parameters():
        if p.grad is not None:
            assert rel_err(got[n], p.grad) <= TOLERANCE, n


class DropoutCounts(torch.nn.Module):
    """loss = the sum of dropout(w) over the batch: w's gradient counts, element by element,
    the samples whose mask kept it (scaled by 1 / (1 - p); a sum's shares weigh 1)."""

    def __init__(self, width=512):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(width, dtype=torch.float64))
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        kept = torch.nn.functional.dropout(self.w.expand(x.shape[0], -1), 0.5, True)
        return kept.sum() + self.lin(x).sum() * 0


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_draws_depend_on_the_seed_step_and_share_only(device):
    """Random operators of a forward draw from a generator seeded from (seed, step, stage,
    microbatch, replica): the same seed gives the same masks whatever the threads' timing;
    another seed or the next step gives others; and every share of the batch gets its own
    (one sample per share, four shares: were they drawn alike, every element of w would be
    kept by all four samples or by none)."""
    torch.manual_seed(0)
    model = DropoutCounts().to(device)
    x = torch.randn(4, 4, dtype=torch.float64, device=device)
    graph = conveyor.capture(model, (x,), {})
    assert graph.executor.unseeded_random_nodes() == []
    stages = graph.random_partition(2, seed=0, keep_node_order=True)
    inputs = graph.flatten_inputs((x,), {})

    def kept_counts(step):
        model.zero_grad(set_to_none=True)
        global_state = torch.get_rng_state()
        step.run(inputs)
        assert torch.equal(torch.get_rng_state(), global_state), "the step drew from torch's global generator"

        # The loss sums over the batch, so each of the 4 shares weighs 1, and kept elements
        # are scaled by 2: the count is half the gradient.
        return (model.w.grad / 2).round().long().cpu()

    first = _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [2, 2], seed=7)
    counts = [kept_counts(first) for _ in range(2)]
    again = _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [2, 2], seed=7)
    assert torch.equal(kept_counts(again), counts[0])  # same seed, same first step
    assert not torch.equal(counts[0], counts[1])  # the next step draws again
    other = _C.PipelineStep(graph.executor, stages, "1f1b", 2, 1, [2, 2], seed=8)
    assert not torch.equal(kept_counts(other), counts[0])
    for c in counts:
        assert set(c.unique().tolist()) <= {0, 1, 2, 3, 4}
        assert ((c > 0) & (c < 4)).sum() > c.numel() // 2, "the shares drew alike"
