"""conveyor.distributed: the processes of one job, and differentiable communication between
them for models split by hand.

The job (processes.py), which conveyor.Module's pipeline joins too: world(), process_group(),
launch_settings(), default_timeout(). For models split by hand: init (UCX, or NCCL for
tensors on the GPU), send, recv, backward and microbatch (communication.py); bcast, gather,
scatter, allgather, alltoall, reduce, reduce_scatter, allreduce and barrier, each over the
job or a group of its processes (collectives.py; new_group and Group, groups.py); and
Sequential, modules placed on processes (sequential.py). docs/split_by_hand.md shows them
at work.

Each module imports only those below it: processes.py (the job's process state, in this one
module), arguments.py (the checks of what a call is passed) and trace.py; then groups.py;
records.py (a process's record of its messages and their answers); exit_checks.py;
communication.py; and collectives.py and sequential.py on top.
"""
from .collectives import allgather, allreduce, alltoall, barrier, bcast, gather, reduce, reduce_scatter, scatter
from .communication import backward, init, microbatch, rank, recv, send, world_size
from .groups import Group, new_group
from .processes import default_timeout, launch_settings, process_group, world
from .sequential import Sequential

__all__ = ["world", "process_group", "default_timeout", "launch_settings", "init", "send", "recv", "bcast", "gather",
           "scatter", "allgather", "alltoall", "reduce", "reduce_scatter", "allreduce", "backward", "microbatch",
           "rank", "world_size", "barrier", "Sequential", "new_group", "Group"]
