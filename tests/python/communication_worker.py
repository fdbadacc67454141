"""Run by test_communication under `conveyor launch -n N`: large messages between processes
(over the sender's shared region and past it), every differentiable collective's forward
values and backward pairing against what they must be, in float64, a stream of sends that
keeps nothing per send, an evaluation that forgot no_grad holding little, then (MISMATCH)
the mismatches: a receive nobody sends (the last process stops calling, or exits), a send
nobody receives. DEVICE=cuda: on CUDA tensors;
TRANSPORT: conveyor.distributed.init's (GPU_PER_PROCESS: process r on GPU LOCAL_RANK)."""
import os
import sys
import warnings

import torch

import conveyor.distributed as dist
from conveyor.errors import ConveyorValueError


def expect(name, got, want):
    got, want = got.cpu(), want.cpu()
    if not torch.equal(got, want):
        raise SystemExit(f"process {dist.rank()}: {name}: got {got.tolist()}, want {want.tolist()}")


def in_message_region(t) -> bool:
    """Whether `t`'s memory lies in a UCX member's message region (a memfd this process maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "conveyor-ucx-messages" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def sends_keep_nothing(me):
    """A script that only sends (inference under no_grad) keeps nothing per send: process 0
    sends 20,000 tensors, process 1 receives them; what process 0 still holds of the Python
    memory allocated meanwhile stays small (a handle kept per send held megabytes)."""
    import tracemalloc
    count = 20000
    with torch.no_grad():
        if me == 0:
            x = torch.ones(4)
            tracemalloc.start()
            for _ in range(count):
                dist.send(x, dst=1)
            dist.recv(src=1)
            kept = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            if kept > 256 << 10:
                raise SystemExit(f"process 0: {count} sends kept {kept} bytes of Python memory")
        elif me == 1:
            for _ in range(count):
                dist.recv(src=0)
            dist.send(torch.ones(1), dst=0)


def evaluation_that_forgot_no_grad_holds_little(me):
    """An evaluation loop that forgot torch.no_grad() on both sides and calls no backward:
    what process 0 sends is freed as process 1 drops each graph (each receive tells its
    sender no gradient comes), not held until process 0's next backward(): 200 sends of 1 MB
    with their graphs."""
    import time
    import weakref
    from conveyor.distributed import communication, records
    count = 200
    if me == 0:
        w = torch.ones(1 << 17, requires_grad=True)
        sent = []
        for _ in range(count):
            y = w * 2
            sent.append(weakref.ref(y))
            dist.send(y, 1)
            del y
        dist.recv(1)  # process 1 received them all
        deadline = time.monotonic() + 10
        while any(r() is not None for r in sent) and time.monotonic() < deadline:
            records.take_answers_in(communication._state)  # what the next send would do
            time.sleep(0.01)
        held = sum(r() is not None for r in sent)
        if held:
            raise SystemExit(f"process 0: {held} of {count} evaluation sends still held")
    elif me == 1:
        for _ in range(count):
            got = dist.recv(0)
            got.sum().item()
        del got
        dist.send(torch.ones(1), 0)


def gradient_past_a_receive_without_one(me, leaf, how):
    """Process 0 sends 2w, then 3w, to process 1, which takes the first under no_grad (`how`
    "no_grad") or drops it without a backward ("dropped": an evaluation that forgot no_grad,
    then training with plain loss.backward()): as in one process it adds no gradient, and
    process 0's backward() must not wait for one (it waited out the timeout); w's gradient
    is the second's alone."""
    w = leaf(1)
    if me == 0:
        dist.send(w * 2, 1)
        dist.send(w * 3, 1)
        dist.backward()
        expect(f"a gradient past a receive ({how})", w.grad, torch.full((2,), 6.0))
    elif me == 1:
        if how == "no_grad":
            with torch.no_grad():
                dist.recv(0)
            dist.backward(2.0 * dist.recv(0).sum())
        else:
            dist.recv(0).sum().item()
            (2.0 * dist.recv(0).sum()).backward()
    else:
        dist.backward()


def refusals_leave_the_numbering_as_it_was(me):
    """A receive on a device nothing can land on (meta) is refused before it takes the
    message, which the next receive gets; ranks may be any whole number (numpy's, a 0-d
    tensor's), as new_group takes them."""
    import numpy
    if me == 0:
        dist.send(torch.arange(3.0), numpy.int64(1))
    elif me == 1:
        try:
            dist.recv(0, device="meta")
            raise SystemExit("recv took device='meta'")
        except ConveyorValueError as e:
            if "device='meta'" not in str(e):
                raise
        expect("the message a refused receive left", dist.recv(torch.tensor(0)), torch.arange(3.0))


def freed_graph_named(me, leaf):
    """A round trip (process 0 sends h, gets g(h) back, its loss reads both) trained with plain
    loss.backward() frees h's graph before backward() can apply h's gradient: named, with what
    to call instead, not autograd's bare "backward through the graph a second time"; and the
    job goes on (every message of the step was answered)."""
    w = leaf(1)
    if me == 0:
        h = torch.tanh(w)
        dist.send(h, 1)
        (dist.recv(1) * h).sum().backward()
        try:
            dist.backward()
            raise SystemExit("backward() applied a gradient through a freed graph")
        except ConveyorValueError as e:
            if "send #" not in str(e) or "freed the graph" not in str(e) or "backward(loss)" not in str(e):
                raise
    elif me == 1:
        dist.send(dist.recv(0) * 3, 0)
        dist.backward()


def _refusal(call) -> str:
    """What `call` was refused with (ConveyorValueError's text), or that it was not."""
    try:
        call()
    except ConveyorValueError as e:
        return str(e)
    return "taken"


def collectives(group, leaf, device, finish):
    """Every collective's forward values and backward pairing, over `group` (None: the job's
    default); `finish(loss)` backpropagates a process's loss: conveyor.distributed.backward,
    or plain loss.backward() (the graph is connected: the collective's own output carries
    what the process sent). A process with no loss calls dist.backward() either way.
    Processes are weighed by their place in the group (me), roots are its first and last."""
    g = group or dist.new_group(range(dist.world_size()))
    me, n, first, last = g.rank, g.size, g.ranks[0], g.ranks[-1]
    over = {} if group is None else {"group": group}
    weight = float(me + 1)  # process p's loss is (p + 1) * sum(what it got)
    every = sum(range(1, n + 1))
    # allreduce: y = sum_p x_p; dL/dx_p = sum_q (q + 1)
    x = leaf(me + 1)
    y = dist.allreduce(x, **over)
    expect("allreduce", y.detach(), torch.full((2,), float(every)))
    finish(weight * y.sum())
    expect("allreduce backward", x.grad, torch.full((2,), float(every)))

    # a large allreduce (4 MB and more: among 3 or more processes, reduce_scatter then
    # allgather), of a non-contiguous tensor whose size the processes do not divide
    x = (torch.arange(3 * 174763.0, device=device).view(-1, 3) * (me + 1)).t().requires_grad_()
    y = dist.allreduce(x, **over)
    expect("a large allreduce", y.detach(), torch.arange(3 * 174763.0, device=device).view(-1, 3).t() * every)
    finish(weight * y.sum())
    expect("a large allreduce's backward", x.grad, torch.full(x.shape, float(every)))

    # bcast from the last process: dL/dx_root = sum_q (q + 1)
    x = leaf(10)
    y = dist.bcast(x if me == n - 1 else None, root=last, device=device, **over)
    expect("bcast", y.detach(), torch.full((2,), 10.0))
    y.mul_(1.0)  # in place, on every process alike (the root's output was refused as a custom Function's view)
    finish(weight * y.sum())
    if me == n - 1:
        expect("bcast backward", x.grad, torch.full((2,), float(every)))

    # gather at the first, then scatter from the first (their backwards pair the other way)
    x = leaf(me)
    parts = dist.gather(x, root=first, **over)
    if me == 0:
        expect("gather", torch.stack(parts).detach(), torch.arange(n, dtype=torch.float64)[:, None].expand(n, 2))
        finish(sum((q + 1) * t.sum() for q, t in enumerate(parts)))
    else:
        dist.backward()
    expect("gather backward", x.grad, torch.full((2,), weight))
    xs = [leaf(100 + q) for q in range(n)] if me == 0 else None
    y = dist.scatter(xs, root=first, device=device, **over)
    expect("scatter", y.detach(), torch.full((2,), 100.0 + me))
    finish(weight * y.sum())
    if me == 0:
        for q in range(n):
            expect("scatter backward", xs[q].grad, torch.full((2,), float(q + 1)))

    # allgather: every process weighs part q by (p + 1) * (q + 1): dL/dx_q = (q + 1) * sum_p (p + 1)
    x = leaf(me)
    parts = dist.allgather(x, **over)
    finish(weight * sum((q + 1) * t.sum() for q, t in enumerate(parts)))
    expect("allgather backward", x.grad, torch.full((2,), float((me + 1) * every)))

    # allgather of a tuple: its own part is connected too (plain loss.backward() applied the
    # others' gradients only for a single tensor; after a tuple's, backward() found the
    # graph freed). dL/da_q = (q + 1) * sum_p (p + 1), dL/db_q twice that.
    a, b = leaf(me), leaf(-me)
    parts = dist.allgather((a * 1, b * 1), **over)
    finish(weight * sum((q + 1) * (u.sum() + 2 * v.sum()) for q, (u, v) in enumerate(parts)))
    expect("allgather of a tuple: backward", a.grad, torch.full((2,), float((me + 1) * every)))
    expect("allgather of a tuple: backward", b.grad, torch.full((2,), float(2 * (me + 1) * every)))

    # alltoall: process p gets xs_q[p]; L_p = (p + 1) * sum; dL/d xs_p[q] = q + 1
    xs = [leaf(10 * me + q) for q in range(n)]
    got = dist.alltoall(xs, **over)
    expect("alltoall", torch.stack(got).detach()[:, 0], torch.tensor([10.0 * q + me for q in range(n)]))
    finish(weight * sum(t.sum() for t in got))
    for q in range(n):
        expect("alltoall backward", xs[q].grad, torch.full((2,), float(q + 1)))

    # What a collective returns is never the caller's own tensor (as the parts received are
    # new ones): written in place, it leaves the input as it was, on every process alike.
    with torch.no_grad():
        x = torch.ones(2, device=device)
        outputs = [*dist.allgather(x, **over), dist.allreduce(x, **over),
                   dist.bcast(x if me == 0 else None, root=first, device=device, **over)]
        gathered = dist.gather(x, root=first, **over)
        for out in outputs + (gathered if me == 0 else []):
            out.add_(5)
        expect("a collective's input after its output was written", x, torch.ones(2))

    # reduce at the last: L = n * sum(the sum); dL/dx_p = n, on every process
    x = leaf(me + 1)
    y = dist.reduce(x, root=last, **over)
    if me == n - 1:
        expect("reduce", y.detach(), torch.full((2,), float(every)))
        finish(weight * y.sum())
    else:
        if y is not None:
            raise SystemExit(f"process {me}: reduce returned {y} away from the root")
        dist.backward()
    expect("reduce backward", x.grad, torch.full((2,), float(n)))

    # reduce_scatter: process p gets sum_q xs_q[p]; dL/d xs_p[q] = q + 1
    xs = [leaf(me + q) for q in range(n)]
    y = dist.reduce_scatter(xs, **over)
    expect("reduce_scatter", y.detach(), torch.full((2,), float(sum(q + me for q in range(n)))))
    finish(weight * y.sum())
    for q in range(n):
        expect("reduce_scatter backward", xs[q].grad, torch.full((2,), float(q + 1)))


def main():
    torch.set_default_dtype(torch.float64)
    transport = os.environ.get("TRANSPORT")  # unset: the job's (ucx)
    if transport:
        if os.environ.get("GPU_PER_PROCESS"):
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init(transport=transport)
    me, n = dist.rank(), dist.world_size()
    weight = float(me + 1)  # process p's loss is (p + 1) * sum(what it got)
    every = sum(range(1, n + 1))

    device = os.environ.get("DEVICE", "cpu")

    def leaf(value):
        return torch.full((2,), float(value), device=device, requires_grad=True)

    if device == "cuda":
        # With no device asked for, CUDA tensors arrive on the receiver's CUDA device, whether
        # they travelled in device memory (UCX's CUDA transports, or NCCL) or through the host
        # (CONVEYOR_UCX_CUDA=0 over UCX); a small, a non-contiguous and a 24 MB tensor, and
        # their gradients.
        sent = [leaf(7), torch.arange(12.0, device=device).reshape(3, 4).t().requires_grad_(),
                torch.arange(3 << 20, dtype=torch.float64, device=device).requires_grad_()]
        scratch = torch.arange(3 << 20, dtype=torch.float64, device=device)  # 24 MB, written again once sent
        if me == 0:
            dist.send(tuple(sent), 1)
            dist.send(scratch, 1)
            scratch.fill_(-1.0)
            dist.backward()
            for t in sent:
                expect("a CUDA send's gradient", t.grad, torch.full(t.shape, 2.0))
        elif me == 1:
            got = dist.recv(0)
            expect("a CUDA tensor written again after it was sent", dist.recv(0),
                   torch.arange(3 << 20, dtype=torch.float64, device=device))
            for t, g in zip(sent, got):
                if g.device.type != "cuda":
                    raise SystemExit(f"process 1: a CUDA tensor arrived on {g.device}, not on a GPU")
                expect("a CUDA tensor received", g.detach(), t.detach())
            dist.backward(weight * sum(g.sum() for g in got))
        else:
            dist.backward()

    if device == "cpu":
        # Large host messages between the processes of a host are written into the sender's
        # shared region and received over it (transport/shared_region.h), up to the sender's
        # window of what its receiver has not released (64 MB); past it they go through UCX.
        # 72 1 MB messages (data: received as they arrive) that the receiver keeps, and a
        # non-contiguous 2 MB one with a gradient: each arrives equal, some of the 72 over the
        # region (none with CONVEYOR_UCX_REGION_MB=0) and some not, and the gradient pairs.
        # The sender writes each of the 72 again as soon as it is sent. Past the region, UCX
        # read a message from the sender's memory later: of 20 16 MB tensors written again
        # once sent, 10 arrived changed, 20 without the region or over tcp. Sends of
        # conveyor.distributed now copy what UCX would read later (Endpoint::send_copied).
        data = [torch.full((1 << 17,), float(k)) for k in range(72)]
        odd = torch.arange(float(1 << 18)).reshape(512, 512).t().requires_grad_()
        if me == 0:
            for t in data:  # written again at once, as a script may: nothing is read from it later
                dist.send(t, 1)
                t.fill_(-1.0)
            dist.send(odd, 1)
            dist.backward()
            expect("a large send's gradient", odd.grad, torch.full(odd.shape, 2.0))
        elif me == 1:
            got = [dist.recv(0) for _ in range(len(data) + 1)]
            for t, g in zip(data + [odd], got):
                expect("a large tensor received", g.detach(), t.detach())
            over_region = sum(in_message_region(g) for g in got[:-1])
            region = os.environ.get("CONVEYOR_UCX_REGION_MB") != "0"
            print(f"process 1: {over_region} of {len(data)} large messages arrived over the sender's region",
                  flush=True)
            if (region and not 0 < over_region < len(data)) or (not region and over_region):
                raise SystemExit(f"process 1: with the region {'on' if region else 'off'}, that is wrong")
            dist.backward(weight * got[-1].sum())
        else:
            dist.backward()

    # A sent tensor written in place afterwards (used on here, say): its gradient flows
    # through its history as it was sent, as in one process (it flowed through the in-place
    # op too: w.grad was 6, not 2).
    w = leaf(1)
    if me == 0:
        y = w * 2
        dist.send(y, 1)
        y.mul_(3)
        dist.backward()
        expect("the gradient of a tensor written again after it was sent", w.grad, torch.full((2,), 2.0))
    elif me == 1:
        dist.backward(dist.recv(0).sum())
    else:
        dist.backward()

    # A receive that gets no gradient: under no_grad, or dropped without a backward.
    gradient_past_a_receive_without_one(me, leaf, "no_grad")
    gradient_past_a_receive_without_one(me, leaf, "dropped")

    # A process that sends and trains with plain loss.backward() leaves out its send's
    # gradient (from y = 3 * (2w)): named at its next call; backward() then applies it.
    w = leaf(1)
    if me == 0:
        dist.send(w * 2, 1)
        dist.recv(1).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.send(torch.ones(1), 1)
        if not any("left out the gradient of send #" in str(c.message) for c in caught):
            raise SystemExit("process 0: loss.backward() left a send's gradient out without a word")
        dist.backward()
        expect("a send's gradient after loss.backward()", w.grad, torch.full((2,), 6.0))
    elif me == 1:
        dist.send(dist.recv(0) * 3, 0)
        dist.backward()
        dist.recv(0)

    collectives(None, leaf, device, dist.backward)
    collectives(None, leaf, device, lambda loss: loss.backward())
    # Two groups at once: the first and last processes, and the rest (or, of 2 processes,
    # the last alone, the first idle); each runs every collective among its own.
    ends = dist.new_group([n - 1, 0])
    if me in ends:
        group = ends if n > 2 else dist.new_group([n - 1])
    else:
        group = dist.new_group(range(1, n - 1))
    if me in group:
        collectives(group, leaf, device, dist.backward)
        collectives(group, leaf, device, lambda loss: loss.backward())
    if n > 2 and me not in ends:
        try:  # a collective of a group this process is not in is refused, naming it
            dist.allreduce(torch.ones(1), group=ends)
            raise SystemExit(f"process {me} ran a collective of {ends}")
        except ConveyorValueError as e:
            if f"allreduce: process {me} is not in group [0, {n - 1}]" not in str(e):
                raise
    # a barrier waits for the slowest process of its group
    import time
    if me == n - 1:
        time.sleep(0.5)
    start = time.monotonic()
    dist.barrier(dist.new_group())
    if time.monotonic() - start < (0.4 if me != n - 1 else 0):
        raise SystemExit(f"process {me} passed the barrier before process {n - 1} reached it")
    print(f"process {me}: every collective and its backward as expected", flush=True)

    if "MISMATCH" not in os.environ:
        sends_keep_nothing(me)
        evaluation_that_forgot_no_grad_holds_little(me)

    try:  # a tensor that cannot travel is refused, naming what to send, and numbers nothing: the
        # calls after it still pair (a refused send used to take a number its receiver waited for)
        dist.send(torch.eye(3).to_sparse(), (me + 1) % n)
        raise SystemExit("a sparse tensor was sent")
    except ConveyorValueError as e:
        if "torch.sparse_coo tensor: send t.to_dense()" not in str(e):
            raise
    # A device no tensor can land on is refused before the message is taken (after, its
    # sender waited out the timeout for its gradient): the next receive still gets it.
    if me == 0:
        dist.send(leaf(4) * 1.0, 1)
        dist.backward()
    elif me == 1:
        for bad, says in [("bogus", "device='bogus' is not a device"), ("cuda:99", "device='cuda:99', but this process sees")]:
            if says not in _refusal(lambda: dist.recv(0, device=bad)):
                raise SystemExit(f"process 1: recv(device={bad!r}) was not refused naming it")
        dist.backward(dist.recv(0).sum())
    refused = []  # a second thread's call is refused, naming both threads, and numbers nothing
    import threading
    helper = threading.Thread(target=lambda: refused.append(_refusal(lambda: dist.send(torch.ones(1), (me + 1) % n))),
                              name="helper")
    helper.start()
    helper.join()
    if "called from thread 'helper', but 'MainThread' communicates for this process" not in refused[0]:
        raise SystemExit(f"process {me}: a second thread's send: {refused[0]}")
    with dist.microbatch(0):  # microbatches do not nest, and their backward comes after the block
        for call, says in [(lambda: dist.microbatch(1).__enter__(), "microbatch(1) inside microbatch(0)"),
                           (dist.backward, "backward() inside `with microbatch(0)`")]:
            try:
                call()
                raise SystemExit(f"{says}: taken")
            except ConveyorValueError as e:
                if says not in str(e):
                    raise
    x = leaf(1)  # two backwards through one received value: the second's gradient is refused
    if me == 0:
        dist.send(x * 2, 1)
        dist.backward()
    elif me == 1:
        y = dist.recv(0)
        (3 * y).sum().backward(retain_graph=True)
        try:
            y.sum().backward()
            raise SystemExit("a second backward through a receive passed")
        except RuntimeError as e:
            if "a gradient reached receive #" not in str(e) or "after its gradient went back" not in str(e):
                raise
    if me == 0:
        expect("the first backward through a receive", x.grad, torch.full((2,), 6.0))
    for bad, says in [([(torch.nn.Identity(), 0, [1])], "item 0 reads 1: expected an earlier item's index"),
                      ([(torch.nn.Identity(), n)], f"item 0's rank {n} is not a process of this job of {n}"),
                      ([(torch.nn.Identity(),)], "item 0 must be (module, rank) or (module, rank, inputs)")]:
        try:  # a Sequential that cannot run is refused when made, naming the item
            dist.Sequential(bad)
            raise SystemExit(f"Sequential took {bad}")
        except ConveyorValueError as e:
            if says not in str(e):
                raise
    try:  # a root that is no process is refused on every process, naming it (it was called "src")
        dist.bcast(torch.ones(1), root=n)
        raise SystemExit("bcast took a root that is no process")
    except ConveyorValueError as e:
        if f"root={n}: expected a process from 0 to {n - 1}" not in str(e):
            raise
    try:
        dist.allreduce(torch.ones(me + 1))
        raise SystemExit("allreduce summed tensors of different shapes")
    except ConveyorValueError as e:
        if "process 0 [1], process 1 [2]" not in str(e):
            raise
    try:  # nor dtypes, which would promote the sum: process 0 asked float32 and got float64
        dist.allreduce(torch.ones(2, dtype=torch.float64 if me else torch.float32))
        raise SystemExit("allreduce summed tensors of different dtypes")
    except ConveyorValueError as e:
        if "differ in dtype: process 0 torch.float32, process 1 torch.float64" not in str(e):
            raise
    for call, says in [(lambda: dist.allreduce((torch.ones(1), torch.ones(1))), "allreduce: expected a tensor, got tuple"),
                       (lambda: dist.reduce_scatter([torch.ones(1)] * (n + 1)), f"expected a list of {n} values"),
                       (lambda: dist.alltoall(None), f"expected a list of {n} values")]:
        if says not in _refusal(call):  # refused on every process before anything is sent
            raise SystemExit(f"{says}: {_refusal(call)}")
    w = torch.ones(2, requires_grad=True)  # a gradient hook that communicates: refused, saying why
    w.register_post_accumulate_grad_hook(lambda p: dist.allreduce(p.grad))
    if "inside a backward pass (activation checkpointing recomputing a forward that communicates, or a gradient " \
            "hook?)" not in _refusal(lambda: w.sum().backward()):
        raise SystemExit("an allreduce in a gradient hook was not refused")
    refusals_leave_the_numbering_as_it_was(me)
    freed_graph_named(me, leaf)
    if os.environ.get("MISMATCH") == "send":
        # Process 0 sends one message more than process 1 receives.
        if me == 0:
            dist.send(torch.ones(1), dst=1)
        sys.exit(0)
    if os.environ.get("MISMATCH") == "checkpoint":
        # Activation checkpointing around a block that communicates: its recomputation in
        # backward would send and receive again; refused, naming why.
        from torch.utils.checkpoint import checkpoint

        def block(x):
            dist.send(torch.sin(x), 1)
            return torch.sin(dist.recv(1))
        if me == 0:
            y = checkpoint(block, leaf(1), use_reentrant=False)
            dist.backward(y.sum())
        elif me == 1:
            dist.send(torch.sin(dist.recv(0)), 0)
            dist.backward()
        sys.exit(0)
    if os.environ.get("MISMATCH") == "call":
        # Process 0 calls allgather where process 1 calls bcast: process 0's receive gets a
        # message of another call, and says so (it passed the value on as allgather's).
        if me == 0:
            dist.allgather(torch.ones(2))
        elif me == 1:
            dist.bcast(torch.ones(2), root=1)
        sys.exit(0)
    if os.environ.get("MISMATCH") == "kill":
        # Process 1 is killed (SIGKILL: no excepthook, no word that it leaves) while process 0
        # waits for its message; process 0 must fail naming it, well before the timeout.
        if me == 0:
            import time
            start = time.monotonic()
            try:
                dist.recv(src=1)
            finally:
                print(f"process 0 failed {time.monotonic() - start:.1f} s after it began waiting", flush=True)
        elif me == 1:
            import signal
            import time
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(0)
    if os.environ.get("MISMATCH") == "group":
        # Process 0 calls allreduce over processes 0 and 1, the others over the whole job:
        # process 1 receives a message of another group's allreduce, and says so.
        dist.allreduce(torch.ones(2), group=dist.new_group([0, 1]) if me == 0 else None)
        sys.exit(0)
    if os.environ.get("MISMATCH") == "caught":
        # Process 1 asks for a message process 0 never sends, and goes on past the error.
        if me == 1:
            try:
                dist.recv(src=0)
            except Exception as e:
                print(f"process 1 went on past: {e}", flush=True)
        sys.exit(0)
    if os.environ.get("MISMATCH") == "unapplied":
        # Process 0 leaves microbatch 1 without its backward(microbatch=1): the gradient process
        # 1 returned is never applied, which process 0 names at exit (it passed unseen).
        w = torch.ones(2, requires_grad=True)
        for k in range(2):
            with dist.microbatch(k):
                if me == 0:
                    dist.send(w * 2, 1)
                elif me == 1:
                    loss = dist.recv(0).sum()
            if me == 1:
                dist.backward(loss, microbatch=k)
            elif me == 0 and k == 0:
                dist.backward(microbatch=0)
        sys.exit(0)
    if os.environ.get("MISMATCH") in ("1", "exit"):
        # Process 0 waits for a message process n - 1 never sends: with "1" it stops calling
        # (a hang, found at the timeout); with "exit" its script ends early with SystemExit(3),
        # which no excepthook sees (it says it leaves, so process 0 fails at once).
        if me == 0:
            dist.recv(src=n - 1)
        elif me == n - 1:
            if os.environ["MISMATCH"] == "exit":
                sys.exit(3)
            import time
            time.sleep(30)
        sys.exit(0)


if __name__ == "__main__":
    main()
