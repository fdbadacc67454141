"""Reading a checkpoint's tensors straight from its files, a block at a time.

DCP's FileSystemWriter stores each tensor item as a `torch.save` archive (an uncompressed
zip) at an offset of a `.distcp` file. Loading one through `torch.distributed.checkpoint`
reads the archive's bytes, unpickles a second tensor from them and copies it into the
target: two temporaries of the tensor's size. Here the archive is parsed instead, its
`data.pkl` with an unpickler that builds nothing but a description (storage key, dtype,
offset, shape, strides), and the storage's bytes are read where they lie, `BLOCK_BYTES` at
a time, into a checksum or straight into the target tensor. An item stored any other way
(a transform, a view into its storage, strides that are not row-major) is not `located`:
the caller reads it through DCP.
"""
from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StoredTensor", "locate", "stored_checksum", "read_into", "BLOCK_BYTES"]

BLOCK_BYTES = 16 << 20  # read at once: what a load holds beside the model


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor item's bytes lie: a file, the offset of its first byte, its length."""
    file: Path
    offset: int
    nbytes: int


class _Region(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (zipfile reads it)."""

    def __init__(self, f, start: int, length: int):
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


class _Described:
    """A tensor as data.pkl describes it, built by nothing else."""

    def __init__(self, storage, offset, size, stride, *_):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


class _DescriptionUnpickler(pickle.Unpickler):
    """Unpickles a torch.save data.pkl of one tensor into a _Described; refuses anything else."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Described
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(kind)
        return (str(key), numel)


def _row_major(size: tuple, stride: tuple) -> bool:
    expected = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def locate(folder: Path, info, nbytes: int) -> StoredTensor | None:
    """Where the bytes of the tensor item that DCP's `_StorageInfo` `info` names lie, if
    stored plainly as a row-major tensor of `nbytes` bytes; else None."""
    if getattr(info, "transform_descriptors", None):
        return None
    file = folder / info.relative_path
    try:
        with open(file, "rb") as f:
            archive = zipfile.ZipFile(_Region(f, info.offset, info.length))
            names = archive.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl")), None)
            if pkl is None:
                return None
            described = _DescriptionUnpickler(io.BytesIO(archive.read(pkl))).load()
            if not isinstance(described, _Described) or described.offset != 0 or \
                    not _row_major(described.size, described.stride):
                return None
            key, _ = described.storage
            member = archive.getinfo(pkl.rsplit("/", 1)[0] + f"/data/{key}")
            if member.compress_type != zipfile.ZIP_STORED or member.file_size != nbytes:
                return None
            f.seek(info.offset + member.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            return StoredTensor(file, info.offset + member.header_offset + 30 + name_len + extra_len, nbytes)
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, TypeError, struct.error,
            EOFError, AttributeError, StopIteration):
        return None  # DCP's own read names what is wrong


def _blocks(stored: StoredTensor):
    """(offset within the tensor, length) of each block."""
    for start in range(0, stored.nbytes, BLOCK_BYTES):
        yield start, min(BLOCK_BYTES, stored.nbytes - start)


def stored_checksum(stored: StoredTensor) -> int | None:
    """CRC-32 of the stored bytes, read a block at a time (None: the file is shorter)."""
    crc, buffer = 0, bytearray(min(BLOCK_BYTES, stored.nbytes))
    with open(stored.file, "rb") as f:
        f.seek(stored.offset)
        for _, n in _blocks(stored):
            view = memoryview(buffer)[:n]
            if f.readinto(view) != n:
                return None
            crc = zlib.crc32(view, crc)
    return crc


def read_into(stored: StoredTensor, target: torch.Tensor) -> None:
    """The stored bytes into `target` (a contiguous CPU tensor of that many bytes)."""
    into = memoryview(target.view(-1).view(torch.uint8).numpy())
    with open(stored.file, "rb") as f:
        f.seek(stored.offset)
        for start, n in _blocks(stored):
            if f.readinto(into[start:start + n]) != n:
                raise OSError(f"{stored.file} ends inside a tensor (at byte {stored.offset + start})")
