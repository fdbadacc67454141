"""Checkpoints of a conveyor.Module in PyTorch's distributed checkpoint format (DCP:
a folder of `__<process>_0.distcp` files and a `.metadata`), so PyTorch's own tools read
them (`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` turns one into a plain
state dict).

Saving (checkpoint_save.py), every process writes only what it owns: the parameters and
buffers the running plan makes it the owner of, and their optimizer state, each once, never
once per replica, with `conveyor.part.<p>`, a checksum per tensor and its non-tensor
optimizer state. Process 0 also writes one object, `conveyor`: the format, the step count,
the plan, the optimizer's class and param groups (parameters by name), torch's random state
and the user's `extra` dict. The folder is written under a temporary name and renamed only
after every process has confirmed its part, so a save that fails midway never leaves a
folder that looks complete.

Loading, every process reads only the tensors it holds under the running plan (what its
stages read), on any plan and any process count: the checkpoint holds whole tensors keyed
by name, and DCP reads each one's bytes wherever they lie. The whole checkpoint is checked
first (its files, names, shapes and checksums), so a truncated, foreign or mismatched one
is refused, naming what is wrong, before any tensor changes.

Keys: `model.<name>` for parameters and buffers (the model's state_dict names, a tied weight
once under its first name), `optim.<name>.<state>` for tensor optimizer state, `conveyor`
and `conveyor.part.<p>` (pickled dicts)."""
from __future__ import annotations

import io
import pickle
import warnings
import zlib
from pathlib import Path

import torch

from .checkpoint_read import BLOCK_BYTES, locate, read_into, stored_checksum
from .errors import ConveyorIOError, ConveyorValueError
from .materialize import is_placeholder

__all__ = ["inspect", "load", "load_hyperparameters", "checksum", "CheckpointTensors", "FORMAT"]

FORMAT = "conveyor checkpoint 2"
META_KEY = "conveyor"
PART_KEY = "conveyor.part"  # `conveyor.part.<p>`: process p's checksums and non-tensor optimizer state


def torch_dcp():
    import torch.distributed.checkpoint as dcp  # imported on use: it pulls in torch.distributed
    return dcp


class CheckpointTensors:
    """A model's parameters and persistent buffers by their first state_dict name (a tied
    weight once), with the process that owns each (the one whose copy a checkpoint writes)
    and whether this process holds it whole (what a load fills here)."""

    def __init__(self, model: torch.nn.Module, *, owner_of: dict[int, int], held_here, shapes: dict[int, list],
                 rank: int):
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor) and all(t is not kept for kept in self.tensors.values()):
                self.tensors[name] = t
        self.names = {id(t): name for name, t in self.tensors.items()}
        self.rank = rank
        self._owner_of, self._held_here, self._shapes = owner_of, held_here, shapes

    def shape(self, name: str) -> list[int]:
        """The tensor's whole shape (a process holds a tensor its stages do not read with 0 elements)."""
        t = self.tensors[name]
        return list(self._shapes.get(id(t), t.shape))

    def owner(self, name: str) -> int:
        return self._owner_of.get(id(self.tensors[name]), 0)

    def mine(self) -> list[str]:
        return [name for name in self.tensors if self.owner(name) == self.rank]

    def needed_here(self) -> list[str]:
        """What a load fills here: the tensors this process's stages read, and those no stage reads."""
        return [name for name, t in self.tensors.items() if self._held_here(t)]


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def read_meta(path) -> tuple[dict, object]:
    """The checkpoint's `conveyor` object and DCP metadata, or a clear refusal naming what is
    wrong (no folder, an unfinished save, a checkpoint conveyor did not write)."""
    dcp = torch_dcp()
    path = Path(path)
    if not path.is_dir():
        staged = path.with_name(path.name + ".incomplete")
        hint = (f"; {staged} is a save that did not finish" if staged.exists() else "")
        raise ConveyorIOError(f"no checkpoint at {path}: not a folder{hint}")
    if not (path / ".metadata").is_file():
        raise ConveyorIOError(f"{path} is not a complete checkpoint: its .metadata is missing (a save that did not "
                              "finish, or not a DCP checkpoint)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a corrupt .metadata: torch raises whatever unpickling raises
        raise ConveyorIOError(f"{path}/.metadata cannot be read ({type(e).__name__}: {e})") from None
    if META_KEY not in metadata.state_dict_metadata:
        raise ConveyorValueError(f"{path} is a DCP checkpoint, but not one conveyor wrote (no '{META_KEY}' entry); "
                                 "save with model.save_checkpoint")
    for item, where in (metadata.storage_data or {}).items():
        if not (path / where.relative_path).is_file():
            raise ConveyorIOError(f"{path} is incomplete: {where.relative_path} is missing (it holds {item.fqn}, "
                                  "among others)")
    holder = {META_KEY: io.BytesIO()}
    _read(path, holder)
    meta = pickle.loads(holder[META_KEY].getvalue())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConveyorValueError(f"{path} was written by another conveyor checkpoint format "
                                 f"({meta.get('format') if isinstance(meta, dict) else '?'}); this one reads {FORMAT}")
    parts = {key: io.BytesIO() for key in metadata.state_dict_metadata if key.startswith(PART_KEY + ".")}
    _read(path, parts)
    meta["checksums"], meta["optimizer_scalars"] = {}, {}
    for part in parts.values():
        written = pickle.loads(part.getvalue())
        meta["checksums"].update(written["checksums"])
        meta["optimizer_scalars"].update(written["optimizer_scalars"])
    return meta, metadata


def _read(path: Path, state: dict) -> None:
    dcp = torch_dcp()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's note that it loads in one process: that is the intent
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except Exception as e:
        raise ConveyorIOError(f"reading {', '.join(list(state)[:3])}{' ...' if len(state) > 3 else ''} from "
                              f"{path} failed: the checkpoint is truncated or corrupt ({type(e).__name__}: {e})") from None


def _empty_like_item(metadata, key: str) -> torch.Tensor:
    info = metadata.state_dict_metadata[key]
    return torch.empty(tuple(info.size), dtype=info.properties.dtype)


def inspect(path, *, optimizer, tensors: CheckpointTensors) -> tuple[dict, object]:
    """Checks that checkpoint `path` is complete and holds this model (every tensor by name,
    shape and dtype) and its optimizer's param groups; returns its `conveyor` object and its
    DCP metadata. Reads no tensor."""
    path = Path(path)
    meta, metadata = read_meta(path)
    stored = metadata.state_dict_metadata
    wanted = [n for n in tensors.tensors if f"model.{n}" not in stored]
    if wanted:
        raise ConveyorValueError(f"{path} lacks {len(wanted)} of the model's tensors ({', '.join(wanted[:4])}"
                                 f"{' ...' if len(wanted) > 4 else ''}): it holds another model")
    for name, t in tensors.tensors.items():
        info = stored[f"model.{name}"]
        if list(info.size) != tensors.shape(name) or info.properties.dtype != t.dtype:
            raise ConveyorValueError(f"{path} holds {name} as {list(info.size)} {info.properties.dtype}, the model "
                                     f"as {tensors.shape(name)} {t.dtype}: it holds another model, or another "
                                     "configuration")
    foreign = [k[len("model."):] for k in stored if k.startswith("model.") and k[len("model."):] not in tensors.tensors]
    if foreign:
        raise ConveyorValueError(f"{path} holds {len(foreign)} tensors the model does not have ({', '.join(foreign[:4])}"
                                 f"{' ...' if len(foreign) > 4 else ''}): it holds another model, or another "
                                 "configuration")
    if optimizer is not None and meta["optimizer_class"] not in (None, type(optimizer).__name__):
        raise ConveyorValueError(f"{path} was saved with a {meta['optimizer_class']} optimizer, this model's is "
                                 f"{type(optimizer).__name__}: its state would not mean the same; make the optimizer "
                                 "as the saving job did")
    if optimizer is not None and meta["optimizer_class"] is None:
        warnings.warn(f"conveyor: {path} was saved without an optimizer: the optimizer's state starts fresh",
                      stacklevel=4)
    if optimizer is not None and meta["param_groups"] is not None:
        if len(meta["param_groups"]) != len(optimizer.param_groups) or any(
                [tensors.names.get(id(p)) for p in g["params"]] != saved["params"]
                for g, saved in zip(optimizer.param_groups, meta["param_groups"])):
            raise ConveyorValueError(f"{path} was saved with other optimizer param groups (its groups name "
                                     f"{[len(g['params']) for g in meta['param_groups']]} parameters): make the "
                                     "optimizer as the saving job did")
    return meta, metadata


def load(path, *, optimizer, tensors: CheckpointTensors) -> dict:
    """Fills the tensors this process holds (and their optimizer state) from checkpoint
    `path`, after checking everything it reads; returns the `conveyor` object (extra, step
    count, param groups). Nothing changes when anything is refused. The optimizer's
    hyperparameters are not set here: load_hyperparameters does, when the load is asked for."""
    path = Path(path)
    meta, metadata = inspect(path, optimizer=optimizer, tensors=tensors)
    stored = metadata.state_dict_metadata
    names = tensors.needed_here()
    keys = [f"model.{n}" for n in names]
    if optimizer is not None:
        keys += [k for k in stored if k.startswith("optim.") and k.rsplit(".", 1)[0][len("optim."):] in set(names)]
    located = _located(path, metadata, keys)
    _check(path, metadata, meta["checksums"], keys, located)
    # Checked: now the tensors and the optimizer state change.
    state: dict = {}
    with torch.no_grad():
        for name in names:
            t = tensors.tensors[name]
            if t.numel() != stored[f"model.{name}"].size.numel() or is_placeholder(t):  # held here from now on
                t.data = torch.empty(tuple(stored[f"model.{name}"].size), dtype=t.dtype, device=t.device)
            state[f"model.{name}"] = t.data if t.device.type == "cpu" else torch.empty_like(t.data, device="cpu")
        for key in keys:
            if key.startswith("optim."):  # into the optimizer's own tensor where it has one alike
                name, _, field = key[len("optim."):].rpartition(".")
                mine = optimizer.state.get(tensors.tensors[name], {}).get(field)
                fresh = _empty_like_item(metadata, key) if not isinstance(mine, torch.Tensor) else None
                alike = fresh is None and mine.device.type == "cpu" and mine.is_contiguous() and \
                    list(mine.shape) == list(stored[key].size) and mine.dtype == stored[key].properties.dtype
                state[key] = mine if alike else (fresh if fresh is not None else _empty_like_item(metadata, key))
        through_dcp = []
        for key, target in state.items():  # straight into the target where it lies plainly, else through DCP
            where = located.get(key)
            if where is not None and target.device.type == "cpu" and target.is_contiguous() and \
                    target.numel() * target.element_size() == where.nbytes:
                read_into(where, target)
            else:
                through_dcp.append(key)
        for chunk in _chunks(through_dcp, metadata):  # DCP reads through temporaries: a chunk's at a time
            _read(path, {key: state[key] for key in chunk})
        for name in names:
            t = tensors.tensors[name]
            if t.device.type != "cpu":
                t.data.copy_(state[f"model.{name}"])
    if optimizer is not None:
        for name in names:
            p = tensors.tensors[name]
            loaded = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == f"optim.{name}"}
            loaded.update(meta["optimizer_scalars"].get(name, {}))
            if loaded:
                optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v
                                      for k, v in loaded.items()}
            else:
                optimizer.state.pop(p, None)
    torch.set_rng_state(meta["rng"])
    return meta


def _located(path: Path, metadata, keys: list[str]) -> dict:
    """Where each item of `keys` lies in its file, where it is stored plainly (checkpoint_read.py)."""
    infos: dict = {}
    for index, info in (metadata.storage_data or {}).items():
        infos.setdefault(index.fqn, []).append(info)
    out = {}
    for key in keys:
        item = metadata.state_dict_metadata[key]
        if len(infos.get(key, [])) == 1:
            out[key] = locate(path, infos[key][0], item.size.numel() * item.properties.dtype.itemsize)
    return out


def load_hyperparameters(optimizer, meta: dict) -> None:
    """The checkpoint's param groups' hyperparameters (lr, weight decay, ...) into `optimizer`,
    at once: what the user sets after load_checkpoint then stays, as with torch's own load."""
    if optimizer is None:
        return
    for g, saved in zip(optimizer.param_groups, meta["param_groups"] or []):
        g.update({k: v for k, v in saved.items() if k != "params"})


def _chunks(keys, metadata):
    """`keys` in runs of BLOCK_BYTES or less (one item at least): what a load reads through DCP at once."""
    chunk, size = [], 0
    for key in keys:
        info = metadata.state_dict_metadata[key]
        chunk.append(key)
        size += info.size.numel() * info.properties.dtype.itemsize
        if size >= BLOCK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _check(path: Path, metadata, checksums: dict, keys: list[str], located: dict) -> None:
    """Compares each item of `keys` with its checksum, naming the first that differs: read a
    block at a time where it lies plainly, else through DCP a chunk at a time."""
    def refuse(key):
        raise ConveyorIOError(f"{path}: {key} is corrupt (its checksum differs from the one saved); restore "
                              "the checkpoint's files from a copy")
    for key in keys:
        if located.get(key) is not None and stored_checksum(located[key]) != checksums.get(key):
            refuse(key)
    for chunk in _chunks([key for key in keys if located.get(key) is None], metadata):
        read = {key: _empty_like_item(metadata, key) for key in chunk}
        _read(path, read)
        for key, t in read.items():
            if checksum(t) != checksums.get(key):
                refuse(key)
