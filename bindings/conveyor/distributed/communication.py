"""Differentiable communication between the processes of a job, for models split by hand:
send and recv here, the collectives built on them in collectives.py; each one's
backward is its paired communication (send <-> recv, bcast -> the gradients summed at the
root, gather <-> scatter, allgather -> reduce-scatter, alltoall <-> alltoall, allreduce ->
allreduce), over the job's process group (UCX: with a GPU, CUDA tensors travel from device
memory into the receiver's current CUDA device through UCX's CUDA transports; without them,
or with CONVEYOR_UCX_CUDA=0, through host memory, and still arrive on that device; what
arrives for a collective lands on the caller's tensor's device). With
`init(transport="nccl")` (or the job's transport nccl) tensors on each process's GPU go GPU
to GPU over NCCL instead.

No delegate variables: a process whose graph the communication cuts (one that sends but
holds no loss) calls `backward()` (with its losses, if any) instead of `loss.backward()`.
It replays the process's communication in reverse program order: each receive's gradient
goes back to its sender (zeros where nothing used it), each send waits for its gradient and
backpropagates it. Sends never block and only receives wait, so the reversed exchange
completes whenever the forward one did (docs/design.md, "Differentiable communication").
Where a process's graph is connected (it only receives, or its loss reads the output of
each collective it sent in), `loss.backward()` works as usual: each receive sends its
gradient back when autograd reaches it, and a collective's own output waits for the
gradients of what the process sent in it (collectives.py).

Every process of the job must call the same functions in the same order (as in MPI); a
mismatch ends within the job's timeout naming the process waited for and the call, and at
once where that process's script already ended (returned or exited). A value received
under torch.no_grad(), or whose graph is dropped without a backward (an evaluation that
forgot no_grad), gets no gradient, as in one process: the receiver tells its sender, which
then lets go of what it sent (its next send looks) and whose backward() skips that send.
A sender under torch.no_grad() records nothing; evaluate under torch.no_grad() on every
process, which costs nothing per send.
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import weakref

import torch
from torch.autograd.graph import get_gradient_edge

from .. import environment
from ..arguments import check_output_path
from ..errors import ConveyorError, ConveyorValueError
from . import arguments, groups, records
from . import trace as tracing
from .exit_checks import check_every_message_was_received
from .processes import default_timeout, launch_settings, process_group

__all__ = ["init", "send", "recv", "backward", "microbatch", "rank", "world_size"]

# The call a message belongs to travels in its flags, so a receive made by another call than
# the send (a collective only some processes reach) fails naming both, not passing a value
# from the wrong call along.
_CALLS = ["send", "bcast", "gather", "scatter", "allgather", "alltoall", "allreduce", "reduce_scatter", "reduce"]

# This process's communication (records.py), made by init() (at the first call, if not before).
_state: records.State | None = None


def init(transport: str | None = None, device=None, trace: str | os.PathLike | None = None) -> None:
    """Chooses how this job's messages travel. Optional, and collective: every process calls
    it, with the same transport, before its first communication (which otherwise chooses the
    job's transport: `conveyor launch --transport`, a job config's `transport`, or
    CONVEYOR_TRANSPORT; else "ucx").

    "ucx": every message over UCX (host memory; CUDA tensors from device memory where UCX has
    its CUDA transports). "nccl": tensors on this process's GPU `device` (default: the
    current CUDA device) go GPU to GPU over NCCL, a two-member NCCL group for each direction
    between two processes; headers and every other tensor over UCX, and what arrives over
    NCCL lands on `device`. Each process needs a GPU of its own (NCCL refuses two members on
    one): call `torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))` first on a machine with
    several. Where a process cannot join (no GPU, NCCL missing), every process fails at once,
    naming it.

    `trace`: a file (default: `conveyor launch --trace`'s) where process 0 writes, as the job
    ends normally, one trace of every process's communication (trace.py;
    Perfetto, or Chrome JSON where it ends in .json). Every process passes the same."""
    global _state
    if _state is not None:
        raise ConveyorValueError("conveyor.distributed.init() comes before the first communication, once per process")
    if transport is None:
        transport = launch_settings().get("transport", "ucx")
    if trace is None:  # the launcher's file itself: one trace of the job, not one per process
        trace = environment.variable("CONVEYOR_TRACE") or None
    check_output_path(trace, "trace")
    if transport not in ("ucx", "nccl"):
        raise ConveyorValueError(f"transport={transport!r}: expected \"ucx\" or \"nccl\"")
    group = _group()
    via = None
    if transport == "nccl":
        if device is None:  # where no GPU is seen, NCCL's check says so on every process
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        device = torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ConveyorValueError(f"device={str(device)!r}: NCCL needs one CUDA device, as 'cuda:0'")
        n = group.world_size
        try:
            via = group.nccl_endpoint(str(device), [(p, q) for p in range(n) for q in range(n) if p != q])
        except ConveyorError as e:
            e.add_note('conveyor.distributed.init(transport="nccl") needs NCCL and a GPU of its own in every process; '
                       'transport="ucx" needs neither')
            raise
    _state = records.State(group, via, tracing.Recorder(os.fspath(trace)) if trace is not None else None)
    atexit.register(check_every_message_was_received, _state)  # runs before the group leaves (LIFO)


def _group():
    group = process_group("conveyor.distributed", default_timeout())
    if group is None:
        raise ConveyorValueError("conveyor.distributed needs the processes of a job: start the script with "
                                 "`conveyor launch -n N -- python script.py`, or set RANK, WORLD_SIZE, MASTER_ADDR "
                                 "and MASTER_PORT as torchrun does")
    return group


def _job() -> records.State:
    if _state is None:
        init()
    return _state


def _communicating() -> records.State:
    """The job's state, for a call that communicates: from one thread per process (the first
    to communicate). Two threads would number one peer's messages in whichever order they
    ran, and the peer would pair them differently from run to run (or take one number twice)."""
    st = _job()
    me = threading.current_thread()
    if st.caller is None:
        st.caller = me
    elif st.caller is not me:
        raise ConveyorValueError(f"conveyor.distributed called from thread {me.name!r}, but {st.caller.name!r} "
                                 "communicates for this process: messages between two processes pair in the order "
                                 "they are made, so one thread per process makes every call")
    return st


def rank() -> int:
    """This process's rank in the job."""
    return _job().group.rank


def world_size() -> int:
    """The number of processes in the job."""
    return _job().group.world_size


def send(x, dst: int) -> None:
    """Sends a tensor, or a tuple of tensors, to process `dst` (shapes and dtypes travel with
    them); returns at once. Its backward receives the gradient `dst` sends back."""
    _send(x, dst)


def _not_in_a_backward(name: str) -> None:
    """Communication inside a backward pass is refused: activation checkpointing that
    recomputes a forward which sent or received would send again, or take the next message
    as this one's (a hang or a wrong value); a gradient hook that receives would block the
    backward while its peer may wait for a gradient this process sends later in it. Say why
    instead."""
    if torch._C._current_graph_task_id() != -1:
        raise ConveyorValueError(f"conveyor.distributed.{name} called inside a backward pass (activation "
                                 "checkpointing recomputing a forward that communicates, or a gradient hook?): "
                                 "checkpoint only code without conveyor.distributed calls, which must run once per "
                                 "forward, and reduce gradients after the backward returns")


def _send(x, dst: int, call: str = "send", group: tuple = ()) -> records.Record | None:
    """send() as part of `call` over the processes `group` (groups.mask; none: point to
    point), returning the record of a send that needs a gradient (else None)."""
    _not_in_a_backward(call)
    st = _communicating()
    dst = arguments.peer(dst, st.group.rank, st.group.world_size, "dst")
    records.name_sends_left_unapplied(st)
    values, sequence = arguments.values(x, call)
    needs = [torch.is_grad_enabled() and t.requires_grad for t in values]
    seq = st.sent[dst]
    key = (sequence, _CALLS.index(call), *(group or st.no_group), *needs, *(t.is_cuda for t in values))
    flags = st.flags.get(key)
    if flags is None:
        flags = st.flags[key] = torch.tensor([int(f) for f in key], dtype=torch.int32)
    payload = [t.detach().contiguous() for t in values] + [flags]
    with tracing.span(st.trace, tracing.SEND, dst, seq):
        st.sends.send(dst, records.MESSAGE_BIT | seq, payload,
                      f"conveyor.distributed: {_named(call)}send #{seq} to process {dst}")
    st.sent[dst] += 1  # counted once sent: a send refused here leaves the numbering as it was
    records.take_answers_in(st, [dst])
    if any(needs):
        # The gradient edges as they are now: a script may write a sent tensor in place
        # afterwards (its new history is not what the receiver got), and the record holds no
        # tensor's memory, only the graph behind it.
        wanted = [t for t, n in zip(values, needs) if n]
        record = records.Record("send", dst, seq, edges=[get_gradient_edge(t) for t in wanted],
                                devices=[t.device for t in wanted], microbatch=st.microbatch)
        st.records.append(record)
        st.answers.post(dst, record.answer_tag)
        st.unanswered[dst].append(record)
        return record
    return None


class _Received(torch.autograd.Function):
    """A receive in the autograd graph: its backward holds (or, outside a replay, sends back)
    the gradient of what was received. `anchor` only gives the node an input that needs a
    gradient, so autograd calls it. The received tensors come in a list, not as inputs:
    outputs that are no input of the node need no copy (an input returned would be cloned)."""

    @staticmethod
    def forward(ctx, anchor, record, values):
        ctx.record = record
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        record = ctx.record
        if record.done:  # its gradient went back: this one would be lost
            raise ConveyorValueError(
                f"conveyor.distributed: a gradient reached receive #{record.seq} from process {record.peer} after its "
                "gradient went back to the sender" + (f" (in microbatch {record.microbatch!r}'s backward)"
                                                      if record.microbatch is not None else "")
                + ": backpropagate each received value once (microbatches must not share a graph)")
        if record.grads is None:
            record.grads = [None] * len(grads)
        for i, g in enumerate(grads):
            if g is not None:
                record.grads[i] = g if record.grads[i] is None else record.grads[i] + g
        if _state is not None and _state.replay is None:  # loss.backward(): back at once
            _state.outside_backward_at = _state.outside_backward_at or len(_state.records)
            _return_gradient(_state, record)
            _state.records.remove(record)
        return None, None, None


def _return_gradient(st: records.State, record: records.Record) -> None:
    """Sends a receive's gradient back to its sender (zeros for values nothing used)."""
    if record.done:
        return
    record.done = True
    grads = record.grads or [None] * len(record.shapes)
    payload = [(g if g is not None else torch.zeros(shape, dtype=dtype, device=device)).detach().contiguous()
               for g, (shape, dtype, device) in zip(grads, record.shapes)]
    with tracing.span(st.trace, tracing.GRADIENT_OUT, record.peer, record.seq):
        st.sends.send(record.peer, record.answer_tag, payload + [st.with_gradients],
                      f"conveyor.distributed: the gradient of receive #{record.seq} from process {record.peer}")


def _answer_without_gradients(st: records.State, peer: int, seq: int, why: str) -> None:
    """Tells `peer` that its message `seq` gets no gradient (its backward() skips that send)."""
    st.sends.send(peer, records.answer_tag(seq), [st.without_gradients],
                  f"conveyor.distributed: receive #{seq} from process {peer} ({why})")


def _no_gradient_will_come(st: records.State, record: records.Record) -> None:
    """A receive's node was freed before its gradient went back: its sender's backward()
    skips that send (it adds nothing, as in one process), instead of waiting for it."""
    if record.done or st is not _state:
        return
    record.done = True
    try:
        _answer_without_gradients(st, record.peer, record.seq, "its graph dropped")
    except ConveyorError:  # an earlier send failed: the next call raises it, where the script can see it
        pass
    if not records.replaying(st, record):  # a replay forgets its own records itself
        try:
            st.records.remove(record)
        except ValueError:
            pass


def _named(call: str) -> str:
    """How a message of `call` is named in errors: "allgather's " (nothing for send/recv)."""
    return "" if call == "send" else f"{call}'s "


def _call_named(call: str, group: tuple, other_group: tuple) -> str:
    """A call as a mismatch names it: with its group where the two sides' groups differ."""
    if group == other_group or not any(group):
        return call
    return f"{call} over {groups.named(group)}"


def recv(src: int, device=None):
    """What process `src` sends next: a tensor, or the tuple it sent, on `device`; by default
    where the sender's was: a CPU tensor on the CPU, a CUDA tensor on this process's current
    CUDA device (whichever way it travelled; on the CPU only where this process sees no GPU).
    Its backward sends the gradient back to `src`."""
    return _recv(src, device)


def _recv(src: int, device=None, call: str = "send", group: tuple = ()):
    """recv() as part of `call` over the processes `group` (groups.mask; none: point to
    point), whose sends the message must come from."""
    name = "recv" if call == "send" else call
    _not_in_a_backward(name)
    st = _communicating()
    src = arguments.peer(src, st.group.rank, st.group.world_size, "src")
    device = arguments.device(device, name)
    records.name_sends_left_unapplied(st)
    seq = st.received[src]
    st.received[src] += 1
    with tracing.span(st.trace, tracing.RECV, src, seq):
        got = st.group.recv(src, records.MESSAGE_BIT | seq, f"conveyor.distributed: {_named(call)}receive #{seq} from "
                            f"process {src}", st.via)
    # flags: sequence, call, the group's words, then per value whether it needs a gradient, is_cuda
    flags, count, w = got[-1].tolist(), len(got) - 1, len(st.no_group)
    sequence, theirs, their_group = bool(flags[0]), _CALLS[flags[1]], tuple(flags[2:2 + w])
    needs, on_cuda = [bool(n) for n in flags[2 + w:2 + w + count]], flags[2 + w + count:]
    group = group or st.no_group
    if theirs != call or their_group != group:
        mine = _call_named(name, group, their_group)
        raise ConveyorValueError(f"conveyor.distributed: process {st.group.rank}'s {mine} received message #{seq} of "
                                 f"process {src}'s {_call_named(theirs, their_group, group)}: every process must make "
                                 "the same calls in the same order")
    if device is None and any(on_cuda) and torch.cuda.is_available():  # staged through the host: back on a GPU
        cuda = torch.device("cuda", torch.cuda.current_device())
        values = [v.to(cuda) if c and not v.is_cuda else v for v, c in zip(got[:-1], on_cuda)]
    else:
        values = [v.to(device) if device is not None else v for v in got[:-1]]
    if any(needs) and not torch.is_grad_enabled():  # the sender's backward must not wait for a gradient
        _answer_without_gradients(st, src, seq, "under torch.no_grad()")
    elif any(needs):
        shapes = [(v.shape, v.dtype, v.device) for v, n in zip(values, needs) if n]
        record = records.Record("recv", src, seq, shapes=shapes, microbatch=st.microbatch)
        st.records.append(record)
        wanted = [v for v, n in zip(values, needs) if n]
        out = _Received.apply(torch.empty(0, requires_grad=True), record, wanted)
        out = out if isinstance(out, tuple) else (out,)
        # Once nothing holds the receive's node (the graph it fed was dropped without a
        # backward, as in an evaluation without no_grad), no gradient can come: say so now.
        weakref.finalize(out[0].grad_fn, _no_gradient_will_come, st, record).atexit = False
        outputs = iter(out)
        values = [next(outputs) if n else v for v, n in zip(values, needs)]
    return tuple(values) if sequence else values[0]


def backward(*roots, microbatch=None) -> None:
    """Backpropagates this process's part of the job: its losses `roots` (none on a process
    that holds no loss), then its communication in reverse program order (each receive's
    gradient back to its sender, each send's gradient from its receiver, backpropagated).
    Every process of the job calls it once per step, after its forward; or, in a pipeline
    written by hand, once per microbatch: `microbatch=k` replays only the communication
    made inside `with microbatch(k):`, leaving the others' for their own backward."""
    st = _communicating()
    if st.microbatch is not None:
        raise ConveyorValueError(f"conveyor.distributed.backward() inside `with microbatch({st.microbatch!r})`: "
                                 "call it after the block")
    st.replay = [r for r in st.records if microbatch is None or r.microbatch == microbatch]
    try:
        with tracing.span(st.trace, tracing.BACKWARD, label=None if microbatch is None else repr(microbatch)):
            _replay(st, roots)
    finally:
        gone, st.replay = set(st.replay), None  # records hash by identity
        st.outside_backward_at = None
        st.records = [r for r in st.records if r not in gone]
        for peer, waiting in st.unanswered.items():
            st.unanswered[peer] = collections.deque(r for r in waiting if r not in gone)
    records.drain(st)


def _replay(st: records.State, roots) -> None:
    """backward()'s work: the losses `roots`, then st.replay's records in reverse."""
    if roots:
        with tracing.span(st.trace, tracing.LOSSES):
            torch.autograd.backward(list(roots), retain_graph=True)
    for record in reversed(st.replay):
        if record.kind == "recv":
            _return_gradient(st, record)
            continue
        if not record.done:
            records.take_answer(st, record)
        if record.grads is not None:  # else none comes (received under no_grad, or dropped): it adds nothing
            with tracing.span(st.trace, tracing.BACKPROPAGATE, record.peer, record.seq):
                _backpropagate(st, record)


def _backpropagate(st: records.State, record: records.Record) -> None:
    """Backpropagates the gradients a send's receiver returned through what was sent. A
    graph a plain loss.backward() already freed (the sent tensor's history shared saved
    values with the loss's) is named with what to call instead of autograd's bare error."""
    try:
        torch.autograd.backward(record.edges, record.grads, retain_graph=True)
    except RuntimeError as e:
        if "backward through the graph a second time" not in str(e):
            raise
        raise ConveyorValueError(
            f"conveyor.distributed.backward(): process {st.group.rank}'s send #{record.seq} to process {record.peer} "
            "has its gradient, but a backward that ran before (a plain loss.backward()?) freed the graph of what was "
            "sent: call conveyor.distributed.backward(loss) instead of loss.backward() (or "
            "loss.backward(retain_graph=True) before backward())") from None


class microbatch:
    """`with microbatch(k):` marks the communication made inside as microbatch `k`'s (any
    value), so that `backward(microbatch=k)` replays it alone: a pipeline written by hand
    may interleave its microbatches' forwards and backwards (1F1B). The schedule is the
    script's: every process's order must complete with receives that wait and sends that
    do not (as GPipe's and 1F1B's do; docs/design.md, "Differentiable communication")."""

    def __init__(self, k):
        if k is None:
            raise ConveyorValueError("microbatch(None): name the microbatch (its index, say)")
        self.k = k

    def __enter__(self):
        st = _communicating()
        if st.microbatch is not None:
            raise ConveyorValueError(f"microbatch({self.k!r}) inside microbatch({st.microbatch!r}): they do not nest")
        st.microbatch = self.k
        self.span = tracing.span(st.trace, tracing.MICROBATCH, label=repr(self.k)).__enter__()
        return self

    def __exit__(self, *exc):
        _state.microbatch = None
        self.span.__exit__(*exc)
        return False
