"""``tzip.save`` and ``tzip.load``: state dicts as compressed ``.tzip`` files.

    tzip.save(model.state_dict(), "model.tzip")              # or {"model": ..., "optim": opt.state_dict(), "step": 7}
    sd = tzip.load("model.tzip", map_location="cpu")

The file is a ``.tzip`` container (docs/container.md) of a safetensors file, so ``tzip decompress model.tzip -o
model.safetensors`` gives a safetensors file holding the same tensors, and ``tzip verify | inspect | extract`` work
on it. Each tensor is one frame, compressed by the daemon with its own dtype (``Client.compress``; a CUDA tensor on
its GPU); everything else is in the safetensors ``__metadata__``.

What is stored, and how
-----------------------
* **Tensors** anywhere in nested dicts, lists and tuples, of every dtype torch has. A tensor's name in the
  safetensors file is its path of keys and indices joined by dots (``model.layers.0.weight``, ``optim.state.3.exp_avg``;
  ``tensor`` for a lone tensor; a name already taken gets ``#2``, ``#3``...). Dtypes that safetensors names (BOOL, U8,
  I8, I16, U16, I32, U32, I64, U64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ, C64) are stored
  under that name and their shape; every other dtype (complex32/128, float8_e8m0fnu, float4 and the sub-byte/bits
  dtypes) as its raw bytes, ``U8 [nbytes]``, with the real dtype and shape in the metadata. Values are stored in C
  order: a non-contiguous tensor comes back contiguous (strides are not kept, as in safetensors). ``nn.Parameter``
  and ``requires_grad`` are kept.
* **Shared tensors**: references to one tensor object, and distinct tensors that are the same view of one storage
  (same storage, offset, shape, strides and dtype, e.g. tied weights in ``model.state_dict()``), are stored once and
  come back as one object, or as views of one tensor, as ``torch.load`` gives them. Views that only overlap (``t``
  and ``t[1:]``) are stored as separate tensors of their own values and come back unshared.
* **Other values** are kept in ``__metadata__["tzip.tree"]``, a JSON description of the whole object (version 1):
  ``null``, booleans, strings, lists, finite floats and integers as themselves; ``{"$tensor": NAME, "dtype", "shape",
  "device", "id"}`` for a tensor; ``{"$dict": [[key, value], ...]}`` (keys of any of these kinds, e.g. the integer
  keys of an optimizer's state), ``{"$odict": [...], "meta": ...}`` for an OrderedDict and its ``_metadata``
  (module versions), ``{"$tuple": [...]}``, ``{"$bytes": base64}``, ``{"$f64": hex bits}`` for inf and NaN (bit
  exact), ``{"$dtype": name}``, ``{"$device": str}``, ``{"$size": [...]}``. Any other object raises TypeError,
  unless ``save(..., allow_pickle=True)``: then it is pickled whole into ``{"$pickle": base64}`` (tensors inside
  it uncompressed), and ``load`` refuses it unless ``weights_only=False``. ``__metadata__["tzip.tree_xxh64"]`` is the
  XXH64 of that JSON: a damaged header raises instead of giving other values.
* Writing is atomic (``tzip._container.atomic_file``): a temporary file in the target's folder, fsynced, renamed over
  the target, the folder fsynced. A crash, a kill or a full disk leaves the old file (or none) under the name.

When the daemon is away, ``save`` stores the tensors uncompressed (codec ``raw`` frames: still a valid ``.tzip``) and
warns once; ``strict=True`` raises :class:`tzip.DaemonUnavailableError` instead. ``load`` reads raw frames without the
daemon; compressed ones need it.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import os
import pickle
import struct
from typing import Any

import torch
import xxhash

from ._container import (ContainerReader, TensorItem, decode_entries, reinterpret, safetensors_layout, torch_dtype_of,
                         write_tensors)
from ._safetensors_header import ContainerError
from ._dlpack import check_supported
from .attaching import checkpoint_codec
from .client import Client, tagged

__all__ = ["save", "load", "TREE_KEY", "TREE_DIGEST_KEY", "FORMAT_KEY", "FORMAT_VERSION"]

#: ``__metadata__`` key of the JSON object tree.
TREE_KEY = "tzip.tree"
#: ``__metadata__`` key of the XXH64 (16 hex digits) of that JSON text.
TREE_DIGEST_KEY = "tzip.tree_xxh64"
#: ``__metadata__`` key of the layout version of files written by :func:`save`.
FORMAT_KEY = "tzip.save"
FORMAT_VERSION = "1"


def _dtype_from_str(name: str) -> torch.dtype:
    d = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return d


def _dtype_str(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


# --------------------------------------------------------------------------------------------- the object tree


def _storage_key(t: torch.Tensor) -> tuple | None:
    """What makes two tensor objects the same view of the same memory (None: never shared, e.g. empty tensors)."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.is_conj(), t.is_neg(), type(t), t.requires_grad)


class _Encoder:
    """Turns an object into the JSON tree, collecting its tensors (names made unique)."""

    def __init__(self, allow_pickle: bool):
        self.allow_pickle = allow_pickle
        self.stored: list[TensorItem] = []
        self._names: set[str] = {"__metadata__"}
        self._by_object: dict[int, tuple[str, int]] = {}  # id(tensor) -> (name, identity id)
        self._by_view: dict[tuple, str] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids stable while encoding
        self._next_id = 0

    def _name(self, path: list[str]) -> str:
        base = ".".join(path) if path else "tensor"
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}#{k}"
        self._names.add(name)
        return name

    def _tensor(self, t: torch.Tensor, path: list[str]) -> dict[str, Any]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{'.'.join(path) or 'the object'}: tensor subclass {type(t).__name__} is not stored by "
                            "tzip.save (DTensor and sharded tensors: tzip.checkpoint.Writer with torch.distributed.checkpoint)")
        check_supported(t)
        known = self._by_object.get(id(t))
        if known is not None:
            name, ident = known
        else:
            self._keep.append(t)
            key = _storage_key(t)
            name = self._by_view.get(key) if key is not None else None
            if name is None:
                name = self._name(path)
                self.stored.append(TensorItem(name, t))
                if key is not None:
                    self._by_view[key] = name
            ident = self._next_id
            self._next_id += 1
            self._by_object[id(t)] = (name, ident)
        node: dict[str, Any] = {"$tensor": name, "id": ident, "dtype": _dtype_str(t.dtype), "shape": list(t.shape),
                                "device": str(t.device)}
        if isinstance(t, torch.nn.Parameter):
            node["parameter"] = True
        if t.requires_grad:
            node["requires_grad"] = True
        return node

    def _key(self, k: Any, path: list[str]) -> Any:
        if isinstance(k, torch.Tensor):
            raise TypeError(f"{'.'.join(path) or 'the object'}: a tensor as a dict key is not stored")
        return self.encode(k, path)

    def _label(self, k: Any) -> str:
        return k if isinstance(k, str) else repr(k) if isinstance(k, tuple) else str(k)

    def encode(self, obj: Any, path: list[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if obj is None or type(obj) in (bool, str, int):  # exact types: a subclass would come back as its base
            return obj
        if type(obj) is float:
            if math.isfinite(obj):
                return obj
            return {"$f64": struct.pack("<d", obj).hex()}
        if type(obj) is list:
            return [self.encode(v, [*path, str(i)]) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {"$tuple": [self.encode(v, [*path, str(i)]) for i, v in enumerate(obj)]}
        if type(obj) in (dict, collections.OrderedDict):
            items = [[self._key(k, path), self.encode(v, [*path, self._label(k)])] for k, v in obj.items()]
            if type(obj) is dict:
                return {"$dict": items}
            node: dict[str, Any] = {"$odict": items}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:  # nn.Module.state_dict()'s per-module versions, read by load_state_dict
                node["meta"] = self.encode(meta, [*path, "_metadata"])
            return node
        if type(obj) is bytes:
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"$dtype": _dtype_str(obj)}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if type(obj) is torch.Size:
            return {"$size": list(obj)}
        if self.allow_pickle:
            return {"$pickle": base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")}
        raise TypeError(f"{'.'.join(path) or 'the object'}: {type(obj).__module__}.{type(obj).__qualname__} is not "
                        "stored by tzip.save (tensors, dicts, OrderedDicts, lists, tuples, str, int, float, bool, None, "
                        "bytes, torch.dtype/device/Size are); pass allow_pickle=True to pickle it")


def save(obj: Any, path: str | os.PathLike, codec: str | None = None, client: Client | None = None, strict: bool = False,
         *, allow_pickle: bool = False) -> int:
    """Saves ``obj`` (a state dict: tensors in nested dicts, OrderedDicts, lists and tuples, with other values; see
    the module docstring) to the ``.tzip`` file ``path``, atomically.

    Args:
        obj: what to save. Tensors may be on the CPU or on CUDA GPUs (compressed on their GPU by the daemon), of
            any dtype.
        path: the file to create or replace (its folder must exist).
        codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (docs/format.md); non-float tensors get 'bytes' under
            'fast' and 'max'. None (default): 'fast' for CUDA tensors and 'auto' for CPU tensors
            (tzip._codec_choice), or 'raw' after ``tzip.detach()`` (tzip.attaching).
        client: the daemon client; None: the process's default client (``tzip._default``). Its requests count as
            the job's checkpoint stream.
        strict: with the default client, raise DaemonUnavailableError when the daemon is away instead of storing
            uncompressed frames with one warning (a client you pass keeps its own ``strict``).
        allow_pickle: pickle objects of other types instead of raising TypeError.

    Returns:
        The size of the written file in bytes.

    Raises:
        TypeError: a value that is not stored (see above) or a tensor subclass. ValueError: unknown codec.
        OSError: the file cannot be written (ENOSPC, EFBIG, EACCES...): ``path`` is then untouched.
        DaemonUnavailableError / DeviceUnavailableError: strict only. TzipDaemonError: the daemon refused a tensor.
    """
    enc = _Encoder(allow_pickle)
    tree = enc.encode(obj, [])
    tree_text = json.dumps(tree, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    metadata = {"format": "pt", FORMAT_KEY: FORMAT_VERSION, TREE_KEY: tree_text,
                TREE_DIGEST_KEY: xxhash.xxh64_hexdigest(tree_text.encode("ascii"))}
    with tagged("checkpoint"):
        write_tensors(path, enc.stored, metadata, codec=checkpoint_codec(codec), client=client, strict=strict)
    return os.path.getsize(path)


# --------------------------------------------------------------------------------------------- loading


def _target_device(location: str, map_location) -> torch.device | None:
    """Where a tensor saved on ``location`` goes under ``map_location`` (torch.load's rules); None: call it."""
    if map_location is None:
        dev = torch.device(location)
    elif isinstance(map_location, (str, torch.device)):
        dev = torch.device(map_location)
    elif isinstance(map_location, dict):
        dev = torch.device(map_location.get(location, location))
    elif callable(map_location):
        return None
    else:
        raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, not "
                        f"{type(map_location).__name__}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"a tensor saved on {location} would go to {dev}, but torch.cuda.is_available() is False: "
                               "pass map_location='cpu' (or a dict or callable) to tzip.load")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"a tensor saved on {location} would go to {dev}, this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s): pass map_location to tzip.load")
    elif dev.type != "cpu":
        raise ValueError(f"tzip.load places tensors on the CPU or CUDA GPUs, not {dev}")
    return dev


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class _Decoder:
    """Rebuilds the object from the JSON tree and the decoded tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], weights_only: bool, path: str):
        self.tensors = tensors
        self.weights_only = weights_only
        self.path = path
        self.objects: dict[int, torch.Tensor] = {}
        self.used: set[str] = set()

    def _bad(self, what: str) -> ContainerError:
        return ContainerError("TZIP_CORRUPT", f"tzip.tree: {what}", self.path)

    def _tensor(self, node: dict) -> torch.Tensor:
        ident = node.get("id")
        if ident in self.objects:  # the same object again
            return self.objects[ident]
        name = node["$tensor"]
        data = self.tensors[name]
        if name in self.used:  # another object over the same memory: an alias, as torch.load gives
            data = data.detach()
        self.used.add(name)
        if node.get("parameter"):
            t = torch.nn.Parameter(data, requires_grad=bool(node.get("requires_grad")))
        elif node.get("requires_grad"):
            t = data.requires_grad_(True)
        else:
            t = data
        self.objects[ident] = t
        return t

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, str, int, float)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or not node:
            raise self._bad(f"unexpected node {node!r:.80}")
        if "$tensor" in node:
            return self._tensor(node)
        if "$dict" in node:
            return {self.decode(k): self.decode(v) for k, v in node["$dict"]}
        if "$odict" in node:
            od = collections.OrderedDict((self.decode(k), self.decode(v)) for k, v in node["$odict"])
            if "meta" in node:
                od._metadata = self.decode(node["meta"])  # type: ignore[attr-defined]
            return od
        if "$tuple" in node:
            return tuple(self.decode(v) for v in node["$tuple"])
        if "$f64" in node:
            return struct.unpack("<d", bytes.fromhex(node["$f64"]))[0]
        if "$bytes" in node:
            return base64.b64decode(node["$bytes"], validate=True)
        if "$dtype" in node:
            return _dtype_from_str(node["$dtype"])
        if "$device" in node:
            return torch.device(node["$device"])
        if "$size" in node:
            return torch.Size(node["$size"])
        if "$pickle" in node:
            if self.weights_only:
                raise pickle.UnpicklingError(f"{self.path} holds pickled objects (saved with allow_pickle=True); "
                                             "tzip.load(..., weights_only=False) unpickles them: only for files you trust")
            return pickle.loads(base64.b64decode(node["$pickle"], validate=True))  # noqa: S301 (the caller opted in)
        raise self._bad(f"unknown node {sorted(node)[:3]}")


def _tensor_nodes(node: Any, out: list[dict]) -> None:
    if isinstance(node, list):
        for v in node:
            _tensor_nodes(v, out)
    elif isinstance(node, dict):
        if "$tensor" in node:
            out.append(node)
            return
        for v in node.values():
            _tensor_nodes(v, out)


def _expected_layout(node: dict) -> tuple[torch.dtype, tuple[int, ...], str, tuple[int, ...]]:
    dtype = _dtype_from_str(node["dtype"])
    shape = tuple(int(d) for d in node["shape"])
    st, fshape, _ = safetensors_layout(dtype, shape)
    return dtype, shape, st, fshape


def load(path: str | os.PathLike, map_location=None, client: Client | None = None, weights_only: bool = True,
         strict: bool = False) -> Any:
    """Loads what :func:`save` wrote (or, for any other ``.tzip`` file, e.g. from ``tzip compress``, a dict of its
    tensors by name, in data-section order).

    Args:
        path: the ``.tzip`` file.
        map_location: as for ``torch.load``: None (each tensor where it was saved), a device or device string
            (``"cpu"``, ``"cuda"``, ``"cuda:1"``), a dict from saved to new locations (``{"cuda:1": "cuda:0"}``), or
            a callable ``f(storage, location)`` returning a storage (called with a CPU storage). Tensors for a GPU
            are decoded on that GPU (their compressed frames are copied there).
        client: the daemon client (None: the default one); files of raw frames need no daemon.
        weights_only: refuse objects that :func:`save` pickled (``allow_pickle=True``); ``False`` unpickles them.
        strict: with the default client, raise DaemonUnavailableError rather than a later error when no daemon can
            be reached.

    Returns:
        The object saved, with every tensor bit for bit as it was (contiguous, on the device ``map_location`` says).

    Raises:
        ContainerError (a ValueError): the file is not a valid ``.tzip`` (``code`` TZIP_CORRUPT, TZIP_TRUNCATED,
            TZIP_CHECKSUM for damaged data, TZIP_UNSUPPORTED), naming the file and tensor. Nothing of a damaged file
            is returned.
        pickle.UnpicklingError: pickled objects and ``weights_only=True``. OSError: the file cannot be read.
        DaemonUnavailableError: compressed frames and no daemon. RuntimeError: a CUDA location without CUDA.
    """
    path = os.fspath(path)
    with ContainerReader(path) as reader:
        meta = reader.metadata or {}
        entries = [e for e in reader.entries if e.kind == "tensor"]
        ours = [k in meta for k in (FORMAT_KEY, TREE_KEY, TREE_DIGEST_KEY)]
        if any(ours) and not all(ours):  # one key damaged: never fall back to reading it as a plain file
            raise ContainerError("TZIP_CORRUPT", f"__metadata__ holds only some of {FORMAT_KEY}, {TREE_KEY}, "
                                 f"{TREE_DIGEST_KEY}", path)
        if all(ours):
            tree = _read_tree(reader, meta)
            nodes: list[dict] = []
            _tensor_nodes(tree, nodes)
            layout: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {}
            for node in nodes:
                try:
                    name = node["$tensor"]
                    dtype, shape, st, fshape = _expected_layout(node)
                    location = str(node["device"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ContainerError("TZIP_CORRUPT", f"tzip.tree: bad tensor node ({e})", path) from None
                e = reader._by_name.get(name)  # noqa: SLF001
                if e is None or e.file_dtype != st or e.file_shape != fshape:
                    raise ContainerError("TZIP_CORRUPT", "the safetensors header does not hold this tensor as the tree "
                                         f"describes it ({st} {list(fshape)})", path, name)
                prev = layout.get(name)
                if prev is not None and prev[:2] != (dtype, shape):
                    raise ContainerError("TZIP_CORRUPT", "tzip.tree: one tensor with two layouts", path, name)
                layout.setdefault(name, (dtype, shape, location))
            if set(layout) != set(reader.tensor_names()):
                extra = sorted(set(reader.tensor_names()) - set(layout))
                raise ContainerError("TZIP_CORRUPT", f"tensors the tree does not name: {extra[:5]}", path)
        else:
            tree = None
            layout = {}
            for e in entries:
                dtype = torch_dtype_of(e.file_dtype)
                if dtype is None:
                    raise ContainerError("TZIP_UNSUPPORTED", f"safetensors dtype {e.file_dtype} has no torch dtype here",
                                         path, e.name)
                if math.prod(e.file_shape) * dtype.itemsize != e.nbytes:
                    raise ContainerError("TZIP_CORRUPT", f"{e.file_dtype} {list(e.file_shape)} does not fill its "
                                         f"{e.nbytes} bytes", path, e.name)
                layout[e.name] = (dtype, e.file_shape, "cpu")

        devices = {name: _target_device(loc, map_location) for name, (_, _, loc) in layout.items()}
        decoded: dict[str, torch.Tensor] = {}
        with tagged("checkpoint"):
            for e, flat in decode_entries(reader, entries, client, device=lambda e: devices[e.name] or torch.device("cpu"),
                                          strict=strict):
                dtype, shape, loc = layout[e.name]
                t = reinterpret(flat, dtype, shape)
                if devices[e.name] is None:  # a callable map_location
                    t = _call_map_location(map_location, t, loc)
                decoded[e.name] = t
    if tree is None:
        return decoded
    return _Decoder(decoded, weights_only, path).decode(tree)


def _call_map_location(fn, t: torch.Tensor, location: str) -> torch.Tensor:
    storage = fn(t.untyped_storage(), location)
    if storage is None:  # torch.load's rule: None means the default, where the tensor was saved
        return t.to(torch.device(location))
    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()
    out = torch.empty(0, dtype=t.dtype, device=storage.device)
    return out.set_(storage, 0, tuple(t.shape), _contiguous_strides(tuple(t.shape)))


def _read_tree(reader: ContainerReader, meta: dict) -> Any:
    text = meta.get(TREE_KEY)
    digest = meta.get(TREE_DIGEST_KEY)
    if not isinstance(text, str) or not isinstance(digest, str):
        raise ContainerError("TZIP_CORRUPT", f"__metadata__ {TREE_KEY} / {TREE_DIGEST_KEY} are not strings", reader.path)
    version = meta.get(FORMAT_KEY)
    if version != FORMAT_VERSION:
        raise ContainerError("TZIP_UNSUPPORTED" if isinstance(version, str) and version.isdigit() else "TZIP_CORRUPT",
                             f"tzip.save layout version {version!r} (this reader knows {FORMAT_VERSION})", reader.path)
    actual = xxhash.xxh64_hexdigest(text.encode("utf-8", "surrogatepass"))
    if actual != digest:
        raise ContainerError("TZIP_CORRUPT", f"tzip.tree digest mismatch (stored {digest}, computed {actual})", reader.path)
    try:
        return json.loads(text)
    except ValueError as e:
        raise ContainerError("TZIP_CORRUPT", f"tzip.tree is not JSON: {e}", reader.path) from None
