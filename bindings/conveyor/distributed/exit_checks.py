"""What conveyor.distributed checks as a process ends normally (communication.py registers
it at init): every process compares the messages each sent to each with those
that one received, and a send nobody received (or a receive nothing was sent for) fails the
job naming both processes; then the job's trace is written, where asked for; then each
names a gradient it never applied."""
from __future__ import annotations

import os
import sys
import time

import torch

from . import records
from . import trace


def check_every_message_was_received(st: records.State) -> None:
    """At exit, every process compares what each sent to each with what that one received:
    a send nobody received fails the job here, naming both processes, instead of passing
    unseen. A collective: it runs only when the process ends normally."""
    if sys.exc_info()[0] is not None:
        return
    named = records.name_sends_left_unapplied(st)
    st.group.leave()  # a process still waiting for a message from this one fails now, naming it
    n = st.group.world_size
    every = torch.zeros(2 * n * n + n, dtype=torch.int64)  # the counts, then which processes trace
    counts, tracing = every[:2 * n * n].view(2, n, n), every[2 * n * n:]
    counts[0, st.group.rank] = torch.tensor(st.sent)       # [0, p, q]: p sent to q
    counts[1, :, st.group.rank] = torch.tensor(st.received)  # [1, p, q]: q received from p
    tracing[st.group.rank] = st.trace is not None
    try:
        records.drain(st)
        st.group.allreduce(every)
    except Exception:  # the job already failed (a peer lost): that error was reported
        return
    unmatched = [(p, q) for p in range(n) for q in range(n) if counts[0, p, q] != counts[1, p, q]]
    if unmatched:
        p, q = unmatched[0]
        sent, received = int(counts[0, p, q]), int(counts[1, p, q])
        what = "a send nobody received" if sent > received else "a receive nothing was sent for"
        if st.group.rank == min(p, q):  # once for the job
            print(f"conveyor.distributed: process {p} sent {sent} messages to process {q}, which asked for {received}: "
                  f"{what} (every process must make the same calls in the same order)", file=sys.stderr, flush=True)
        st.group.abort(what)
        os._exit(1)
    if tracing.any():
        try:
            trace.write_at_exit(st, tracing.tolist())
        except Exception as e:  # noqa: BLE001 - a peer lost while handing its record over
            print(f"conveyor.distributed: the trace was not written: {e}", file=sys.stderr, flush=True)
    if not named:
        _name_gradients_never_applied(st)


def _name_gradients_never_applied(st) -> None:
    """At exit, after every process's script ended: a send whose gradient came but which no
    backward() applied, or a tagged send or receive never backpropagated (a `with
    microbatch(k):` left without its backward(microbatch=k)), is named on stderr, once per
    process (unless the loss.backward() warning just named them). Each process sent all its
    answers before the counts' allreduce, so a tagged send's answer still missing is on its
    way or never comes: it is given ANSWERS_IN_FLIGHT_S to arrive. An untagged receive still
    waiting is not named: an evaluation that forgot no_grad and kept its output is no
    mistake."""
    deadline = time.monotonic() + ANSWERS_IN_FLIGHT_S
    while True:
        for peer, waiting in st.unanswered.items():
            for record in [r for r in waiting if st.answers.arrived(peer, r.answer_tag)]:
                waiting.remove(record)
                records.take_answer(st, record)
        left = [r for r in st.records if (r.kind == "send" and r.grads is not None) or r.microbatch is not None]
        if not any(r.kind == "send" and not r.done for r in left) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if left:
        r = left[0]
        tag = f" (microbatch {r.microbatch!r})" if r.microbatch is not None else ""
        what = (f"send #{r.seq} to process {r.peer}{tag} got its gradient, which no backward() applied"
                if r.kind == "send" and r.grads is not None else
                f"{r.kind} #{r.seq} {'to' if r.kind == 'send' else 'from'} process {r.peer}{tag} was never "
                "backpropagated")
        print(f"conveyor.distributed: warning: process {st.group.rank}'s {what} ({len(left)} message(s) in all): "
              f"call backward({'microbatch=' + repr(r.microbatch) if r.microbatch is not None else ''}) for every "
              "forward that trains", file=sys.stderr, flush=True)


# At exit, how long a tagged send's answer (sent before its receiver's script ended) is
# given to arrive before the send is named as never backpropagated.
ANSWERS_IN_FLIGHT_S = 2.0
