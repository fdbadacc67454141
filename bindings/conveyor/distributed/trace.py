"""conveyor.distributed's trace of a job: each process records its communication as it runs
(the span of each send and receive, whose length is mostly the receive's wait; each
collective around its messages; each `with microbatch(k):` block; each backward() and, in
it, the backward of the losses, each gradient returned to a sender, each wait for a send's
gradient and its backward through what was sent). As the job ends normally, every process
hands its record to the others and process 0 writes one trace: a track per process, a flow
from each send to its receive and from each gradient returned to the wait for it. The time
between two spans of a process is its own computation.

Asked for by `conveyor launch --trace FILE` (or a job config's `trace`, or CONVEYOR_TRACE),
or `conveyor.distributed.init(trace=FILE)`: a Perfetto protobuf trace, or Chrome JSON where
FILE ends in .json (ui.perfetto.dev opens both). Times are each host's wall clock, so the
processes of one host line up exactly and those of several as well as their clocks agree.
A process records at most EVENTS_PER_PROCESS spans (the first ones; about 100 bytes each,
held until the end), and its track then says where it stopped.
"""
from __future__ import annotations

import json
import sys
import time

from .. import _C

EVENTS_PER_PROCESS = 200_000

# What a span is: its kind, with the peer and message number where it has them.
SEND, RECV, GRADIENT_OUT, GRADIENT_IN, BACKPROPAGATE, BACKWARD, LOSSES, MICROBATCH, CALL = range(9)


class Recorder:
    """This process's spans: (start ns, end ns, kind, peer, message number, label index)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[tuple] = []
        self.labels: dict[str, int] = {}  # a label's text -> its index (microbatches, collectives' names)
        self.full_at: int | None = None   # when a span first found the record full

    def add(self, start: int, kind: int, peer: int, seq: int, label: str | None) -> None:
        if len(self.rows) >= EVENTS_PER_PROCESS:
            if self.full_at is None:
                self.full_at = start
            return
        index = -1 if label is None else self.labels.setdefault(label, len(self.labels))
        self.rows.append((start, time.time_ns(), kind, peer, seq, index))


class _Span:
    __slots__ = ("recorder", "kind", "peer", "seq", "label", "start")

    def __init__(self, recorder, kind, peer, seq, label):
        self.recorder, self.kind, self.peer, self.seq, self.label = recorder, kind, peer, seq, label

    def __enter__(self):
        self.start = time.time_ns()
        return self

    def __exit__(self, *exc):
        self.recorder.add(self.start, self.kind, self.peer, self.seq, self.label)
        return False


class _Nothing:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOTHING = _Nothing()


def span(recorder: Recorder | None, kind: int, peer: int = -1, seq: int = -1, label: str | None = None):
    """`with span(st.trace, SEND, dst, seq):` records the block where the job traces (costs
    next to nothing where it does not)."""
    return _NOTHING if recorder is None else _Span(recorder, kind, peer, seq, label)


def _name(kind: int, peer: int, seq: int, label: str | None) -> str:
    if kind == SEND:
        return f"send #{seq} to {peer}"
    if kind == RECV:
        return f"recv #{seq} from {peer}"
    if kind == GRADIENT_OUT:
        return f"gradient of recv #{seq} back to {peer}"
    if kind == GRADIENT_IN:
        return f"gradient of send #{seq} from {peer}"
    if kind == BACKPROPAGATE:
        return f"backward through send #{seq} to {peer}"
    if kind == BACKWARD:
        return "backward()" if label is None else f"backward(microbatch={label})"
    if kind == LOSSES:
        return "backward of the losses"
    return f"microbatch {label}" if kind == MICROBATCH else label  # CALL: the collective's name


def _flow(sender: int, receiver: int, seq: int, gradient: bool, n: int) -> int:
    """The flow id of message `seq` from `sender` to `receiver` (or of its gradient, going
    back): both of its ends compute it."""
    return 1 + ((((sender * n + receiver) << 38) | seq) << 1 | int(gradient))


def _flows(process: int, kind: int, peer: int, seq: int, n: int) -> list:
    if kind == SEND:
        return [_flow(process, peer, seq, False, n)]
    if kind == RECV:
        return [_flow(peer, process, seq, False, n)]
    if kind == GRADIENT_OUT:  # a receive's gradient, back to its sender
        return [_flow(peer, process, seq, True, n)]
    if kind == GRADIENT_IN:
        return [_flow(process, peer, seq, True, n)]
    return []


def write_at_exit(st, tracing: list) -> None:
    """Every process hands its record to the others (a collective, as the job ends normally;
    `tracing`: per process, whether it recorded); process 0 writes the trace. Where only some
    processes recorded (init(trace=...) on some), none is written, saying why. A failure to
    write is said on stderr: the job's work is done."""
    recorder: Recorder | None = st.trace
    group = st.group
    if not all(tracing):
        if recorder is not None and group.rank == tracing.index(1):  # once for the job
            print(f"conveyor.distributed: no trace written: processes {[p for p, t in enumerate(tracing) if t]} "
                  f"traced and {[p for p, t in enumerate(tracing) if not t]} did not (pass the same trace= to "
                  "init() on every process, or use conveyor launch --trace)", file=sys.stderr, flush=True)
        return
    mine = json.dumps({"rows": recorder.rows, "labels": list(recorder.labels), "full_at": recorder.full_at}).encode()
    records = [json.loads(group.broadcast_bytes(p, mine if p == group.rank else b"")) for p in range(group.world_size)]
    if group.rank != 0:
        return
    try:
        spans = write(recorder.path, records)
    except Exception as e:  # noqa: BLE001 - named on stderr; the job itself succeeded
        print(f"conveyor.distributed: the trace could not be written to {recorder.path}: {e}", file=sys.stderr,
              flush=True)
        return
    print(f"conveyor.distributed: trace of {len(records)} processes ({spans} slices) written to {recorder.path}; "
          "waiting for messages: " + ", ".join(f"process {p} {waiting(r)}" for p, r in enumerate(records)),
          file=sys.stderr, flush=True)


def waiting(record: dict) -> str:
    """How much of a process's traced time (its first slice's start to its last's end) went
    in receives and in waits for gradients: "12.3 of 40.1 ms (31%)"."""
    rows = record["rows"]
    if not rows:
        return "nothing traced"
    traced = max(end for _, end, *_ in rows) - min(start for start, *_ in rows)
    waited = sum(end - start for start, end, kind, *_ in rows if kind in (RECV, GRADIENT_IN))
    return f"{waited / 1e6:.1f} of {traced / 1e6:.1f} ms ({100 * waited / max(traced, 1):.0f}%)"


def write(path: str, records: list) -> int:
    """Writes the processes' `records` (each a dict of rows, labels and full_at) as one trace;
    returns how many slices it holds. A flow goes from a send (or a gradient sent back) to an
    empty slice "arrived: ..." where its receive's wait ended: Perfetto draws a flow from the
    slice that begins first, and a receive usually begins waiting before its send. A flow
    whose other end is not in the trace (past a full record) is left out."""
    n = len(records)
    flows_of = []
    uses: dict[int, int] = {}
    for p, record in enumerate(records):
        per_row = [_flows(p, kind, peer, seq, n) for _, _, kind, peer, seq, _ in record["rows"]]
        for fs in per_row:
            for f in fs:
                uses[f] = uses.get(f, 0) + 1
        flows_of.append(per_row)
    trace = _C.PerfettoTrace()
    spans = 0
    for p, record in enumerate(records):
        track = trace.add_track(f"process {p}")
        labels = record["labels"]
        for (start, end, kind, peer, seq, label), fs in zip(record["rows"], flows_of[p]):
            fs = [f for f in fs if uses[f] > 1]
            name = _name(kind, peer, seq, labels[label] if label >= 0 else None)
            if kind in (RECV, GRADIENT_IN):  # the flow lands where the wait ends: an empty slice there
                trace.slice(track, start, end, name)
                trace.slice(track, end, end, "arrived: " + (f"#{seq} from {peer}" if kind == RECV else name), fs)
                spans += 2
            else:
                trace.slice(track, start, end, name, fs)
                spans += 1
        if record["full_at"] is not None:
            trace.instant(track, record["full_at"], f"trace full: spans after the first {EVENTS_PER_PROCESS} "
                          "not recorded")
    trace.write(str(path))
    return spans
