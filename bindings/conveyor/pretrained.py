"""Pretrained weights in transformers' folder format: `model.load_pretrained(folder)` reads
what `save_pretrained` writes (safetensors shards and their `model.safetensors.index.json`,
or one `model.safetensors`), and `model.save_pretrained(folder)` writes such a folder, which
`transformers.AutoModel*.from_pretrained(folder)` loads without conveyor.

Loading, every process reads only the tensors it holds under the running plan (what its
stages read; before the first call: checked now, read once the plan exists), each through
safetensors' lazy reads: a shard is mapped, never read whole. Names match as transformers
matches them: the model's state_dict names, with the model's `base_model_prefix` added or
stripped (a GPT2Model checkpoint loads into GPT2LMHeadModel, and back); a tied weight takes
whichever of its names the folder holds, so a head tied to the embedding may be absent. A
floating tensor stored in another floating dtype is converted to the model's dtype, as
from_pretrained converts to the model's. Every tensor of the model is checked first (present,
shape, dtype) in every process, from the shards' headers alone, so a folder of another
model or configuration is refused, naming the tensor, before any tensor changes. What the
folder holds beyond the model is left (a warning names it, unless the model's
`_keys_to_ignore_on_load_unexpected` does). Key conversions transformers applies to legacy
or fused checkpoints are not made: load such a folder with from_pretrained, then wrap.

Saving, every process writes one shard, `model-<k>-of-<n>.safetensors`, of the tensors it
owns (each once, a tied weight under its first name); process 0 writes the index (its
`weight_map` and `metadata.total_size`) and, for a transformers model, `config.json` (with
`architectures` and `dtype` set as save_pretrained sets them) and `generation_config.json`.
A folder with one writer holds `model.safetensors` alone, as save_pretrained writes it. As
a checkpoint, the folder is written under `<folder>.incomplete` and renamed once every
process has written its part."""
from __future__ import annotations

import copy
import json
import re
import shutil
import warnings
from pathlib import Path

import torch

from .checkpoint import CheckpointTensors
from .checkpoint_save import agreed_folder, publish
from .exchange import exchange
from .errors import ConveyorIOError, ConveyorValueError

__all__ = ["loader", "check", "load", "save", "INDEX", "SINGLE"]

WHAT = "save_pretrained"

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def _safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ConveyorValueError("pretrained folders are read and written with the safetensors package: "
                                 "pip install safetensors") from None
    return safetensors


def _open(file: Path):
    try:
        return _safetensors().safe_open(str(file), framework="pt")
    except (OSError, ConveyorValueError):
        raise
    except Exception as e:  # safetensors' own error for a corrupt or truncated header
        raise ConveyorIOError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); save it "
                              "again with save_pretrained") from None


def _files(folder: Path) -> dict[str, Path]:
    """Every tensor name the folder holds, with the file that holds it."""
    if not folder.is_dir():
        raise ConveyorIOError(f"no pretrained folder at {folder}")
    index = folder / INDEX
    if not index.is_file():
        if not (folder / SINGLE).is_file():
            raise ConveyorIOError(f"{folder} holds neither {INDEX} nor {SINGLE}: write it with save_pretrained "
                                  "(safetensors; pytorch_model.bin is not read)")
        with _open(folder / SINGLE) as f:
            return {key: folder / SINGLE for key in f.keys()}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ConveyorValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e}): it must be JSON "
                                 "with a \"weight_map\" of tensor names to shard files; write it again with "
                                 "save_pretrained") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConveyorValueError(f"{index}: its \"weight_map\" must map tensor names to shard file names")
    for name in sorted(set(weight_map.values())):
        if not (folder / name).is_file():
            raise ConveyorIOError(f"{folder} is incomplete: {name}, which its index names, is missing")
    return {key: folder / name for key, name in weight_map.items()}


def _candidates(name: str, prefix: str) -> list[str]:
    """The names transformers would find `name` under: itself, then with the base-model
    prefix stripped (a base model's checkpoint) or added (a checkpoint of the model with a head)."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


def _with_prefix(prefix: str) -> str:
    return f", and with {prefix!r} added or stripped" if prefix else ""


def _ignored(name: str, patterns) -> bool:
    return any(re.search(p, name) for p in patterns or [])


def check(folder, *, model: torch.nn.Module, tensors: CheckpointTensors) -> dict[str, tuple[Path, str]]:
    """Checks that `folder` holds every tensor of the model with its shape and a dtype it can
    take, from the shards' headers alone; returns where each is stored (model name: file,
    stored name). A tensor the model's `_keys_to_ignore_on_load_missing` names may be absent."""
    folder = Path(folder)
    files = _files(folder)
    prefix = getattr(model, "base_model_prefix", "") or ""
    aliases: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), []).append(name)
    where, missing = {}, []
    for name, t in tensors.tensors.items():
        found = [key for alias in aliases.get(id(t), [name]) for key in _candidates(alias, prefix) if key in files]
        if found:
            where[name] = (files[found[0]], found[0])
        elif not _ignored(name, getattr(model, "_keys_to_ignore_on_load_missing", None)):
            missing.append(name)
    if missing:
        raise ConveyorValueError(
            f"{folder} lacks {len(missing)} of the model's tensors ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}; looked up as named{_with_prefix(prefix)}): "
            "it holds another model; build the model from the folder's config.json (AutoConfig.from_pretrained)")
    for file in sorted(set(f for f, _ in where.values())):
        with _open(file) as f:
            held = set(f.keys())
            for name, (_, key) in ((n, w) for n, w in where.items() if w[0] == file):
                if key not in held:
                    raise ConveyorIOError(f"{folder}: the index puts {key} in {file.name}, which does not hold it; "
                                          "write the folder again with save_pretrained")
                stored = f.get_slice(key)
                shape, dtype, t = list(stored.get_shape()), DTYPES.get(stored.get_dtype()), tensors.tensors[name]
                if shape != tensors.shape(name):
                    raise ConveyorValueError(f"{folder} holds {key} as {shape}, the model's {name} is "
                                             f"{tensors.shape(name)}: it holds another configuration; build the "
                                             "model from the folder's config.json")
                if dtype is None or (dtype != t.dtype and not (dtype.is_floating_point and t.dtype.is_floating_point)):
                    raise ConveyorValueError(f"{folder} holds {key} as {stored.get_dtype()}, the model's {name} is "
                                             f"{t.dtype}: only a floating dtype converts to another")
    used = {key for _, key in where.values()}
    unexpected = [k for k in files if k not in used and not _ignored(
        k, getattr(model, "_keys_to_ignore_on_load_unexpected", None))]
    if unexpected:
        warnings.warn(f"the model has no use for {len(unexpected)} of {folder}'s tensors ({', '.join(unexpected[:4])}"
                      f"{' ...' if len(unexpected) > 4 else ''}); they are not read", stacklevel=3)
    return where


def load(folder, *, model: torch.nn.Module, tensors: CheckpointTensors) -> None:
    """Fills the tensors this process holds from `folder`, converted to the model's dtypes,
    after checking every tensor of the model; nothing changes when anything is refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check warned when the load was asked for
        where = check(folder, model=model, tensors=tensors)
    by_file: dict[Path, list[str]] = {}
    for name in tensors.needed_here():
        if name in where:
            by_file.setdefault(where[name][0], []).append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with _open(file) as f:
                for name in names:
                    t, shape = tensors.tensors[name], tensors.shape(name)
                    if list(t.shape) != shape or _stands_in(t):  # released or never made here: held from now on
                        t.data = torch.empty(shape, dtype=t.dtype, device="cpu" if t.is_meta else t.device)
                    t.data.copy_(f.get_tensor(where[name][1]))


def loader(folder, model: torch.nn.Module, tensors: CheckpointTensors):
    """Checks `folder` now and returns the load to run once the plan exists (PendingLoads)."""
    check(folder, model=model, tensors=tensors)
    return lambda held: load(folder, model=model, tensors=held)


def save(folder, *, model: torch.nn.Module, tensors: CheckpointTensors, group) -> None:
    """Writes `folder` (collective: every process calls it): each process a shard of what it
    owns, process 0 the index and the configuration; complete once every part is written."""
    st = _safetensors().torch
    rank = group.rank if group is not None else 0
    names = tensors.mine()
    unmade = [n for n in names if _stands_in(tensors.tensors[n])][:1]
    folder = agreed_folder(folder, group, WHAT, f"{unmade[0]} is not made yet (a model built on the meta device "
                           "makes its tensors once the plan exists): call save_pretrained after the first call"
                           if unmade else None)
    staging = folder.with_name(folder.name + ".incomplete")
    shares = exchange(group, len(names), WHAT)
    writers = [r for r, count in enumerate(shares) if count]
    mine = _unshared({name: tensors.tensors[name] for name in names})
    error = None
    if rank == 0:
        error = _attempt(lambda: _make_empty(staging))
    if (first := exchange(group, error, WHAT)[0]) is not None:
        raise ConveyorIOError(f"saving {folder}: {staging} cannot be made ({first})")
    file = None
    if mine:  # the shard's name as save_pretrained numbers them
        k = writers.index(rank)
        file = SINGLE if len(writers) == 1 else f"model-{k + 1:05d}-of-{len(writers):05d}.safetensors"
        error = _attempt(lambda: st.save_file(mine, str(staging / file), metadata={"format": "pt"}))
    written = exchange(group, (file, {n: t.numel() * t.element_size() for n, t in mine.items()}, error), WHAT)
    failed = [(r, e) for r, (_, _, e) in enumerate(written) if e]
    if rank == 0 and not failed:
        error = _attempt(lambda: _finish(staging, folder, model, written, len(writers)))
    if not failed and (last := exchange(group, error, WHAT)[0]) is not None:
        failed = [(0, last)]
    if failed:
        raise ConveyorIOError(f"saving {folder}: process {failed[0][0]} could not write its part ({failed[0][1]}); "
                              f"{staging} is left unfinished")


def _finish(staging: Path, folder: Path, model, written: list, writers: int) -> None:
    """Process 0's part once every shard is written: the index, the configuration, the name."""
    if writers > 1:
        weight_map = {name: file for file, sizes, _ in written for name in sizes}
        index = {"metadata": {"total_size": sum(s for _, sizes, _ in written for s in sizes.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]
        dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), None)
        if dtype is not None:
            config.dtype = str(dtype).split(".")[1]
        config.save_pretrained(staging)
        can_generate = getattr(model, "can_generate", None)
        if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
    publish(staging, folder, _pretrained_owns)


def _pretrained_owns(name: str) -> bool:
    """The names save_pretrained writes (the rest of a folder, a tokenizer, stays)."""
    return name in (SINGLE, INDEX, "config.json", "generation_config.json") or \
        (name.startswith("model-") and name.endswith(".safetensors"))


def _stands_in(t: torch.Tensor) -> bool:
    """Whether `t` only stands for its tensor: on the meta device, or its shape over one
    element (a meta-built model's tensor before the plan makes it here)."""
    return t.is_meta or (t.numel() > 1 and all(stride == 0 for stride in t.stride()))


def _unshared(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, contiguous, none sharing memory with another (safetensors refuses that)."""
    out, storages = {}, set()
    for name, t in named.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in storages else t
        storages.add(storage)
    return out


def _attempt(step) -> str | None:
    """None when `step()` succeeds, else what went wrong (sent to every process, so all raise)."""
    try:
        step()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _make_empty(path: Path) -> None:
    if path.exists():  # a save that did not finish
        shutil.rmtree(path)
    path.mkdir(parents=True)
