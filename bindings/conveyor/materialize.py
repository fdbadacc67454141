"""Models built on the meta device (`with torch.device("meta"): model = GPT(config)`): no
process holds the whole model. conveyor.Module gives each meta tensor a placeholder of its
shape that holds one element (a stride-0 view on the CPU), in new Parameter objects that the
model's modules and the optimizer then hold; captures it by exporting under meta twins of
its tensors; profiles it unit by unit, making a unit's tensors only while it is measured
(planning.profile); and once the plan exists each process makes on its device only the
parameters and buffers its stages read, initialized so that a tensor's values depend only
on the job's seed and its name, never on the plan or the process count:

- by the user's `init=` callable, `init(name, meta_tensor) -> tensor`, where given;
- else by the model's own initializers, called as the model would call them: transformers'
  `_init_weights` on every module from the leaves up (as its `init_weights` applies it), or
  each module's `reset_parameters`. Every random draw into a parameter or buffer comes from
  a generator seeded with (seed, the tensor's name), so a tensor drawn in one process equals
  the same tensor drawn in another, whatever else that process made.

Compared with building the model eagerly: the distributions are the model's own, but the
values differ, since eager construction draws one stream in module order (the same model
built eagerly twice with the same torch.manual_seed is equal; a meta-built one equals
itself under any plan). A model whose weights come from a checkpoint or pretrained folder is
filled from it instead (load_checkpoint, load_pretrained)."""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import math

import torch
from torch.overrides import TorchFunctionMode

from .arguments import check_model
from .errors import ConveyorValueError

__all__ = ["check_meta_model", "adopt_meta_model", "is_placeholder", "restore_placeholders", "exported_on_meta",
           "materialize", "units_made"]

# In-place random fills: each takes `generator=`, which a seeded one is given.
_RANDOM_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
                 torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
                 torch.Tensor.cauchy_}
_TAKES_GENERATOR: dict = {}


def _takes_generator(func) -> bool:
    """Whether `func` draws at random and takes `generator=` (torch.nn.init's initializers,
    the Tensor fills): a mode's handler runs with the mode off, so what they call inside is
    not seen; the generator must be given at this call."""
    if func in _RANDOM_FILLS:
        return True
    if func not in _TAKES_GENERATOR:
        try:
            _TAKES_GENERATOR[func] = "generator" in inspect.signature(func).parameters
        except (TypeError, ValueError):
            _TAKES_GENERATOR[func] = False
    return _TAKES_GENERATOR[func]


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its first name (a tied weight once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` stands for a tensor no process made here yet: its shape over one element."""
    return t.numel() > 1 and all(st == 0 for st in t.stride())


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    data = torch.empty(1, dtype=t.dtype).expand(t.shape)
    return torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data


def restore_placeholders(tensors, shapes: dict) -> None:
    """Those of `tensors` a pipeline released here (0 elements) made placeholders of their
    shape in `shapes` (by id) again: what a new capture's executor binds to."""
    with torch.no_grad():
        for t in tensors:
            if t.numel() == 0 and id(t) in shapes and math.prod(shapes[id(t)]) > 0:
                t.data = torch.empty(1, dtype=t.dtype, device=t.device).expand(shapes[id(t)])


def _slots(model: torch.nn.Module):
    """Every (module, dict, key) holding a parameter or buffer (a tied one in each slot)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None:
                    yield module, table, key


def adopt_meta_model(model: torch.nn.Module, optimizer) -> dict[int, torch.Size]:
    """Gives every meta tensor of `model` a placeholder (tied slots the same one) and the
    optimizer's param groups the new parameters. Returns each new tensor's shape by id
    (what a later capture exports it at, once a pipeline released it here to 0 elements);
    empty for a model with no meta tensor."""
    made: dict[int, torch.Tensor] = {}
    for _, table, key in list(_slots(model)):
        t = table[key]
        if t.is_meta:
            if id(t) not in made:
                made[id(t)] = _placeholder(t)
            table[key] = made[id(t)]
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [made.get(id(p), p) for p in group["params"]]
    return {id(t): t.shape for t in made.values()}


@contextlib.contextmanager
def exported_on_meta(model: torch.nn.Module, which=lambda t: True, shapes: dict | None = None):
    """While torch.export traces a model that was built on the meta device: every parameter
    and buffer slot (of those `which` picks) holds a meta tensor of its shape (the inputs must
    be meta too) and of its shape in `shapes` (by id) where given; after, the slots hold
    their own tensors again. Yields the live tensors by their meta twins, to bind the graph
    to ({id(meta twin): live tensor})."""
    slots = [(m, table, key) for m, table, key in _slots(model) if which(table[key])]
    own = [table[key] for _, table, key in slots]
    twins: dict[int, torch.Tensor] = {}
    twin_of_own: dict[int, torch.Tensor] = {}
    for (_, table, key), t in zip(slots, own):
        if id(t) not in twin_of_own:
            meta = torch.empty((shapes or {}).get(id(t), t.shape), dtype=t.dtype, device="meta")
            twin = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) \
                else meta
            twin_of_own[id(t)] = twin
            twins[id(twin)] = t
        table[key] = twin_of_own[id(t)]
    try:
        yield twins
    finally:
        for (_, table, key), t in zip(slots, own):
            table[key] = t


def check_meta_model(model: torch.nn.Module, optimizer, init) -> None:
    """Refuses, before any work, what is not a model and optimizer (arguments.check_model), an
    `init` that is no callable, and for a model on the meta device: some of its tensors real,
    or an optimizer holding tensors it does not have."""
    check_model(model, optimizer)
    tensors = _named_tensors(model)
    meta = [n for n, t in tensors.items() if t.is_meta]
    if init is not None and not callable(init):
        raise ConveyorValueError(f"init={init!r}: expected a function (name, meta_tensor) -> tensor")
    if not meta:
        return  # an optimizer may also train what feeds the model (its inputs' gradients)
    if optimizer is not None:
        mine = {id(t) for t in tensors.values()}
        foreign = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in mine]
        if foreign:
            raise ConveyorValueError(f"the optimizer holds {len(foreign)} tensors the model built on the meta device "
                                     "does not have (whose own are made after planning); make it from "
                                     "model.parameters() of the model given to conveyor.Module")
    real = [n for n, t in tensors.items() if not t.is_meta]
    if real:
        raise ConveyorValueError(f"{len(meta)} of the model's tensors are on the meta device ({', '.join(meta[:3])}"
                                 f"{' ...' if len(meta) > 3 else ''}) and {len(real)} are real ({', '.join(real[:3])}"
                                 f"{' ...' if len(real) > 3 else ''}): build the whole model under "
                                 "`with torch.device('meta'):`, or none of it")
    if init is not None:
        _dry_run_init(init, tensors)


def _check_init_value(name: str, value, t: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(t.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConveyorValueError(f"init({name!r}) returned {got}; {name} is {tuple(t.shape)} "
                                 f"{t.dtype}: return a tensor of that shape")


def _dry_run_init(init, tensors: dict) -> None:
    """`init` called once per tensor on the meta device (its factories make shapes, not
    values), so that a wrong shape is refused before any work. An `init` that needs real
    tensors to run is checked when it runs, after planning."""
    with torch.device("meta"), torch.no_grad():
        for name, t in sorted(tensors.items()):  # in the order materialize calls it
            try:
                value = init(name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
            except Exception:
                return
            _check_init_value(name, value, t)


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


class _SeededInit(TorchFunctionMode):
    """While a model's initializers run: every random fill of a tracked tensor draws from a
    generator seeded with (seed, its name); every in-place write marks it initialized."""

    def __init__(self, names: dict[int, str], seed: int):
        super().__init__()
        self.names, self.seed, self.written = names, seed, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        target = target if isinstance(target, torch.Tensor) else None
        name = self.names.get(id(target)) if target is not None else None
        if name is not None and not target.is_meta and not is_placeholder(target):
            if _takes_generator(func) and kwargs.get("generator") is None:
                kwargs["generator"] = torch.Generator(device=target.device).manual_seed(_tensor_seed(self.seed, name))
            if getattr(func, "__name__", "").endswith("_"):
                self.written.add(id(target))
        return func(*args, **kwargs)


def _init_calls(model: torch.nn.Module, modules: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """`modules` and their ancestors, from the leaves up (children before their parent, in
    order), as torch's Module.apply visits them."""
    wanted = set()
    for name in modules:
        parts = name.split(".") if name else []
        wanted.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    out: list[tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module):
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if full in wanted:
                visit(full, child)
        out.append((prefix, module))

    visit("", model)
    return out


def materialize(model: torch.nn.Module, wanted, device: torch.device, *, seed: int, init=None,
                fill: bool = True) -> int:
    """Makes the placeholders among `wanted` (tensors of `model`) on `device`, in place (the
    same Parameter objects, so the optimizer and the captured graph keep them), and
    initializes them (`fill`: False when a checkpoint fills them next). Returns the bytes made."""
    tensors = _named_tensors(model)
    chosen = {id(t) for t in wanted}
    todo = {name for name, t in tensors.items() if id(t) in chosen and is_placeholder(t)}
    if not todo:
        return 0
    made_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in todo)
    owner: dict[str, str] = {}  # tensor -> the module that holds it directly (its first name's)
    for name in todo:
        owner[name] = name.rpartition(".")[0]
    with torch.no_grad():
        for name in sorted(todo):
            t = tensors[name]
            t.data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if not fill:
        return made_bytes
    made = {id(tensors[n]): n for n in todo}
    if init is not None:
        with torch.no_grad():
            for name in sorted(todo):
                t = tensors[name]
                value = init(name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                _check_init_value(name, value, t)
                t.copy_(value)
        return made_bytes
    hf_init = getattr(model, "_init_weights", None) if hasattr(model, "config") else None
    mode = _SeededInit(made, seed)
    # What this process does not make stays meta while the initializers run: they pass over it.
    with exported_on_meta(model, is_placeholder), mode, torch.no_grad(), torch.random.fork_rng(devices=[]):
        for module_name, module in _init_calls(model, set(owner.values())):
            torch.manual_seed(_tensor_seed(seed, "module:" + module_name))  # draws into anything else
            if hf_init is not None:
                hf_init(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
    left = sorted(n for n in todo if id(tensors[n]) not in mode.written)
    if left:
        modules = sorted({owner[n] or type(model).__name__ for n in left})
        raise ConveyorValueError(f"no initializer sets {', '.join(left[:4])}{' ...' if len(left) > 4 else ''} "
                                 f"(module {', '.join(modules[:3])}: no reset_parameters, and the model has no "
                                 "_init_weights): pass init=lambda name, meta: ... to conveyor.Module, or load its "
                                 "weights with load_checkpoint or load_pretrained before the first call")
    return made_bytes


@contextlib.contextmanager
def units_made(tensors: list[torch.Tensor], device: torch.device):
    """While the profiler measures a unit: its tensors that are placeholders made on `device`
    with values that serve timing, then placeholders again (their gradients dropped)."""
    made = [t for t in tensors if is_placeholder(t)]
    with torch.no_grad():
        for t in made:
            t.data = torch.empty(t.shape, dtype=t.dtype, device=device).normal_(0, 0.02) \
                if t.is_floating_point() else torch.zeros(t.shape, dtype=t.dtype, device=device)
    try:
        yield made
    finally:
        with torch.no_grad():
            for t in made:
                t.data = torch.empty(1, dtype=t.dtype).expand(t.shape)
                t.grad = None
