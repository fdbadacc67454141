"""This process's record of its communication for models split by hand: each send and
receive that awaits a gradient (Record), in program order, with the job's message numbering
(State, made at communication.init()); and the answers to its sends (their gradients, or
word that none comes), taken as they arrive or waited for. communication.py sends and
receives; backward() and the collectives' plain loss.backward() apply the answers taken here.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch

from .. import _C
from . import groups
from . import trace as tracing

# Tags (below the pipeline's collective and lane bits): messages carry a per-pair sequence
# number, their gradients the same number with the gradient bit.
MESSAGE_BIT = 1 << 45
GRADIENT_BIT = 1 << 44


@dataclass(eq=False)  # by identity: `in` and remove() never compare the tensors held
class Record:
    """One send or receive of this process, in program order, for the backward replay."""
    kind: str                    # "send" or "recv"
    peer: int
    seq: int
    edges: list = field(default_factory=list)     # send: the gradient edges of those sent that need one
    devices: list = field(default_factory=list)   # send: their devices
    shapes: list = field(default_factory=list)    # recv: (shape, dtype, device) per value needing one
    grads: list | None = None                     # recv: accumulated gradients; send: those that came
    done: bool = False                            # recv: answered; send: its answer taken
    consumed: bool = False                        # send: its gradient applied outside a replay
    microbatch: object = None                     # the microbatch() it was made in, if any

    @property
    def answer_tag(self) -> int:
        return answer_tag(self.seq)


def answer_tag(seq: int) -> int:
    """The tag of the gradient (or the word that none comes) answering message `seq`."""
    return MESSAGE_BIT | GRADIENT_BIT | seq


class State:
    """This process's communication: its member of the job, its messages' numbering per peer,
    the records the backward replays and the answers its sends wait for."""

    def __init__(self, group, via=None, recorder=None):
        self.group = group
        self.via = via                           # the NCCL lane endpoint messages go over, or None: UCX
        self.trace: tracing.Recorder | None = recorder  # where the job is traced (trace.py)
        self.sent = [0] * group.world_size       # per peer: messages sent so far
        self.received = [0] * group.world_size   # per peer: messages received so far
        self.records: list[Record] = []
        self.sends = _C.SendsInFlight(group, via)  # sent, not yet known to have arrived
        # Each send that needs a gradient posts the receive of its answer at once; per peer,
        # those sends whose answer this process has not taken yet, oldest first.
        self.answers = _C.PostedReceives(group, via)
        self.unanswered: dict[int, collections.deque] = {p: collections.deque() for p in range(group.world_size)}
        self.flags: dict[tuple, torch.Tensor] = {}  # a message's flags tensor, per flags (never written)
        self.no_group = (0,) * groups.words(group.world_size)  # a point-to-point message's group
        # A gradient message ends with one of these: the gradients follow, or none will (the
        # value was received under torch.no_grad(), or the graph it fed was dropped).
        self.with_gradients = torch.ones(1, dtype=torch.int8)
        self.without_gradients = torch.zeros(1, dtype=torch.int8)
        self.replay: list[Record] | None = None  # during backward(): the records it goes through, then forgets
        self.microbatch = None           # the microbatch() the process is in, if any
        self.caller: threading.Thread | None = None  # the thread that communicates (the first to)
        # A backward outside backward() (plain loss.backward()) that reached a receive: the
        # sends recorded before it whose gradients it left unapplied are named at the next
        # call, once, unless backward() runs first.
        self.outside_backward_at: int | None = None  # the records' count then
        self.warned_of_outside_backward = False


def name_sends_left_unapplied(st: State) -> bool:
    """After a plain loss.backward() that reached a receive, the process calls again without
    backward() in between: a send recorded before it that needs a gradient (not answered
    that none comes) never had it applied; warn once, naming it, instead of training on
    without it (backward() after loss.backward(), or backward(loss), applies it). Whether it
    warned now."""
    if st.outside_backward_at is None:
        return False
    seen, st.outside_backward_at = st.outside_backward_at, None
    take_answers_in(st)
    left = [r for r in st.records[:seen] if r.kind == "send" and (not r.done or r.grads is not None)]
    if left and not st.warned_of_outside_backward:
        st.warned_of_outside_backward = True
        r = left[0]
        warnings.warn(f"conveyor.distributed: process {st.group.rank}'s loss.backward() left out the gradient of "
                      f"send #{r.seq} to process {r.peer} ({len(left)} send(s) in all): a process that sends calls "
                      "conveyor.distributed.backward(loss) instead, which waits for those gradients and applies "
                      "them (backward() after loss.backward() applies them where that freed none of their graph)",
                      stacklevel=_callers_level())
        return True
    return False


def _callers_level() -> int:
    """warnings.warn's stacklevel for the first frame outside conveyor.distributed (the script's call)."""
    here, level = os.path.dirname(__file__), 2  # 1: warnings.warn's caller; 2: its caller
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        frame, level = frame.f_back, level + 1
    return level


def take_answers_in(st: State, peers=None) -> None:
    """Takes the answers already in for the oldest sends to `peers` (default: every peer),
    without waiting: a send whose receiver says no gradient will come (it received under
    no_grad, or dropped the graph) is forgotten, freeing what it held (an evaluation that
    forgot no_grad would otherwise hold every batch's graph until the next backward()); a
    gradient is kept for backward()."""
    for peer in st.unanswered if peers is None else peers:
        waiting = st.unanswered[peer]
        while waiting and st.answers.arrived(peer, waiting[0].answer_tag):
            take_answer(st, waiting.popleft())


def consume_answers(st: State, records: list) -> list:
    """Outside a replay (a collective's node reached by plain loss.backward()): per record of
    `records`, the gradients its receiver returns for the values sent that needed one (a
    None each where none comes), waiting for each in turn. Each record is consumed: the
    replay will not apply it again."""
    grads = []
    for record in records:
        if not record.consumed and not record.done:
            if record in st.unanswered[record.peer]:
                st.unanswered[record.peer].remove(record)
            take_answer(st, record)
        came = None if record.consumed else record.grads
        grads.extend(came if came is not None else [None] * len(record.edges))
        record.consumed, record.grads = True, None
        if record in st.records:
            st.records.remove(record)
    return grads


def replaying(st: State, record: Record) -> bool:
    """Whether a running backward() goes through `record` (and forgets it after)."""
    return st.replay is not None and record in st.replay


def take_answer(st: State, record: Record) -> None:
    """The answer to a send (waiting for it within the timeout): its gradients, each on its
    sent tensor's device (one staged through the host arrives on the CPU, and autograd
    refuses a gradient on another device than its tensor's), or none."""
    with tracing.span(st.trace, tracing.GRADIENT_IN, record.peer, record.seq):
        *grads, follow = st.answers.take(record.peer, record.answer_tag, "conveyor.distributed: the gradient of "
                                         f"send #{record.seq} to process {record.peer}")
    record.done = True
    if follow.item():
        record.grads = [g.to(d) for g, d in zip(grads, record.devices)]
    elif not replaying(st, record):  # nothing comes: it adds nothing (a replay forgets its own)
        st.records.remove(record)


def drain(st: State) -> None:
    """Waits until every peer has what this process sent (so none is lost at exit)."""
    st.sends.wait()
