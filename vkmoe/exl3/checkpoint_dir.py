"""exllamav3-format model directories read lazily: one model.safetensors, several *.safetensors, or shards listed
by model.safetensors.index.json. Part of the format layer so that every loader (vkmoe.exl3.loaders, hence
Exl3MoeMlp.from_safetensors) accepts a model directory; vkmoe.models re-exports it."""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

from .errors import CheckpointError, MissingTensorError

__all__ = ["Checkpoint", "open_checkpoint", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
           "U8": np.uint8, "BOOL": np.bool_}
MAX_FILE_BYTES = 2 ** 62  # beyond any file (a larger offset overflowed the seek: a ValueError, not a CheckpointError)


class _SafetensorsFile:
    """Header-only open; tensors are read on demand. Our own reader because numpy has no bfloat16 (HF routers
    are often bf16): BF16 is widened to float32 exactly."""

    def __init__(self, path):
        self.path = path
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) != 8:
                    raise CheckpointError(f"{path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > 100_000_000:
                    raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: safetensors file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
        except OSError as exc:  # a directory, no permission, an I/O error
            raise CheckpointError(f"{path}: cannot read it ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file (the header is not a JSON object)")
        self.data_start = 8 + n
        header.pop("__metadata__", None)
        self.header = header

    def keys(self):
        return self.header.keys()

    def read(self, key) -> np.ndarray:
        dtype, shape, begin, end = self._entry(key)
        nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        if nbytes != end - begin:  # (before allocating: a bad shape asked numpy for terabytes)
            raise CheckpointError(f"{self.path}: tensor {key}: {end - begin} bytes stored for {dtype}{list(shape)}")
        out = np.empty(shape, dtype=_DTYPES[dtype])
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(memoryview(out.reshape(-1)).cast("B")) != out.nbytes:
                raise CheckpointError(f"{self.path}: tensor {key} is truncated")
        if dtype == "BF16":
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out

    def _entry(self, key):
        """(dtype, shape, begin, end) of a tensor's header entry, every field checked: integers (not "4", 4.5 or
        true), a shape of sizes >= 0, offsets 0 <= begin <= end within the file's size limit. A negative begin read
        the header's own bytes as the tensor."""
        info = self.header[key]
        bad = lambda what: CheckpointError(f"{self.path}: malformed header entry for tensor {key}: {what}")  # noqa: E731
        if not isinstance(info, dict):
            raise bad(f"expected an object, got {type(info).__name__}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(v) and v >= 0 for v in shape):
            raise bad(f"shape must be a list of integers >= 0, got {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(v) for v in offsets) \
                or not 0 <= offsets[0] <= offsets[1] <= MAX_FILE_BYTES:
            raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        return dtype, tuple(shape), offsets[0], offsets[1]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class Checkpoint:
    """Dict-like view (keys(), [key], `in`) over a model directory's safetensors, sharded or not.

    Accepted by vkmoe.exl3's loaders as a source. Missing keys raise MissingTensorError naming key and directory.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory")
        self._files = {}
        self._where = {}
        index = os.path.join(self.path, INDEX_NAME)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {exc}") from None
            for key, fname in weight_map.items():
                # a shard is a file name in this directory ("../x" or "/etc/..." read files outside it)
                if not isinstance(fname, str) or not fname or os.path.basename(fname) != fname or fname in (".", ".."):
                    raise CheckpointError(f"{index}: the shard of {key} must be a file name in {self.path}, got "
                                          f"{fname!r}")
                fpath = os.path.join(self.path, fname)
                if fname not in self._files:
                    if not os.path.exists(fpath):
                        raise CheckpointError(f"{index}: shard {fname} (holding {key}) does not exist")
                    self._files[fname] = _SafetensorsFile(fpath)
                self._where[key] = fname
        else:
            single = os.path.join(self.path, "model.safetensors")
            names = ["model.safetensors"] if os.path.exists(single) else sorted(
                n for n in os.listdir(self.path) if n.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no {INDEX_NAME}")
            for fname in names:
                sf = self._files[fname] = _SafetensorsFile(os.path.join(self.path, fname))
                for key in sf.keys():
                    if key in self._where:
                        raise CheckpointError(f"{self.path}: tensor {key} is in both {self._where[key]} and {fname}")
                    self._where[key] = fname

    def keys(self):
        return self._where.keys()

    def __contains__(self, key):
        return key in self._where

    def __len__(self):
        return len(self._where)

    def __getitem__(self, key):
        fname = self._where.get(key)
        if fname is None:
            raise MissingTensorError(f"tensor {key} not found in checkpoint {self.path}")
        sf = self._files[fname]
        if key not in sf.header:
            raise CheckpointError(f"{INDEX_NAME} maps {key} to {fname}, but that file does not contain it")
        return sf.read(key)

    def subset(self, prefix: str) -> dict:
        """{key: lazy} restricted to keys under `prefix` (cheap key scans for the EXL3 loaders)."""
        return _Subset(self, [k for k in self._where if k.startswith(prefix)])

    def __repr__(self):
        return f"Checkpoint({self.path!r}, {len(self._where)} tensors in {len(self._files)} file(s))"


class _Subset:
    def __init__(self, parent, keys):
        self._parent, self._keys = parent, keys
        self.path = parent.path

    def keys(self):
        return self._keys

    def __contains__(self, key):
        return key in self._parent

    def __getitem__(self, key):
        return self._parent[key]


def open_checkpoint(path) -> Checkpoint:
    return Checkpoint(path)
