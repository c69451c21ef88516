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
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import xxhash

from ._container import ContainerError, ContainerReader, ContainerWriter, Entry, atomic_file, encode_safetensors_header
from ._default import resolve_client
from ._dlpack import check_supported, int_alias
from .client import Client
from .compressed import CompressedTensor

__all__ = ["save", "load", "TREE_KEY", "TREE_DIGEST_KEY", "FORMAT_KEY", "FORMAT_VERSION", "SAFETENSORS_DTYPES",
           "torch_dtype_of", "codec_view", "decode_entries"]

#: ``__metadata__`` key of the JSON object tree.
TREE_KEY = "tzip.tree"
#: ``__metadata__`` key of the XXH64 (16 hex digits) of that JSON text.
TREE_DIGEST_KEY = "tzip.tree_xxh64"
#: ``__metadata__`` key of the layout version of files written by :func:`save`.
FORMAT_KEY = "tzip.save"
FORMAT_VERSION = "1"
#: Bytes of input per compress or decompress request; two requests are in flight (one being coded, one written).
BATCH_BYTES = 64 << 20


def _dt(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


#: torch dtype -> the safetensors dtype name it is stored under (those the ``safetensors`` package reads back).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {d: n for d, n in [
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.int16, "I16"), (_dt("uint16"), "U16"),
    (torch.int32, "I32"), (_dt("uint32"), "U32"), (torch.int64, "I64"), (_dt("uint64"), "U64"),
    (torch.float16, "F16"), (torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float64, "F64"),
    (_dt("float8_e4m3fn"), "F8_E4M3"), (_dt("float8_e5m2"), "F8_E5M2"), (_dt("float8_e4m3fnuz"), "F8_E4M3FNUZ"),
    (_dt("float8_e5m2fnuz"), "F8_E5M2FNUZ"), (torch.complex64, "C64"),
] if d is not None}
_TORCH_OF_NAME = {n: d for d, n in SAFETENSORS_DTYPES.items()}


def torch_dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name (None when torch or this module has no such dtype)."""
    return _TORCH_OF_NAME.get(name)


def _dtype_from_str(name: str) -> torch.dtype:
    d = _dt(str(name).removeprefix("torch."))
    if d is None:
        raise ValueError(f"unknown torch dtype {name!r}")
    return d


def _dtype_str(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def codec_view(t: torch.Tensor, codec_dtype: str, codec_shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` as the daemon must see it so that its frame has the container's codec layout (docs/container.md,
    "Entries"): ``t`` itself when its dtype is the codec dtype and its shape the codec shape, else its bytes in C
    order as a 1-D uint8 tensor (same device)."""
    if SAFETENSORS_DTYPES.get(t.dtype) == codec_dtype and tuple(t.shape) == tuple(codec_shape):
        return t
    src = int_alias(t.detach().resolve_conj().resolve_neg())
    return src.contiguous().view(torch.uint8).reshape(-1)


# --------------------------------------------------------------------------------------------- the object tree


@dataclass
class _Stored:
    """One tensor of the safetensors file."""

    name: str
    tensor: torch.Tensor
    st_dtype: str
    file_shape: tuple[int, ...]
    nbytes: int


def _storage_key(t: torch.Tensor) -> tuple | None:
    """What makes two tensor objects the same view of the same memory (None: never shared, e.g. empty tensors)."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            type(t), t.requires_grad)


class _Encoder:
    """Turns an object into the JSON tree, collecting its tensors (names made unique)."""

    def __init__(self, allow_pickle: bool):
        self.allow_pickle = allow_pickle
        self.stored: list[_Stored] = []
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
                st = SAFETENSORS_DTYPES.get(t.dtype)
                nbytes = t.numel() * t.element_size()
                self.stored.append(_Stored(name, t, st or "U8", tuple(t.shape) if st else (nbytes,), nbytes))
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
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if type(obj) is int:
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


def _alignment_rank(s: _Stored) -> int:
    # Biggest elements first, as the safetensors package orders them: every tensor starts at a multiple of its
    # element size (the data section starts at a multiple of 8).
    return -min(8, s.tensor.element_size() if s.st_dtype != "U8" else 1)


def _batches(entries: list[Entry], limit: int = BATCH_BYTES) -> list[list[Entry]]:
    out: list[list[Entry]] = []
    cur: list[Entry] = []
    size = 0
    for e in entries:
        if cur and size + e.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        out.append(cur)
    return out


def save(obj: Any, path: str | os.PathLike, codec: str = "auto", client: Client | None = None, strict: bool = False,
         *, allow_pickle: bool = False) -> int:
    """Saves ``obj`` (a state dict: tensors in nested dicts, OrderedDicts, lists and tuples, with other values; see
    the module docstring) to the ``.tzip`` file ``path``, atomically.

    Args:
        obj: what to save. Tensors may be on the CPU or on CUDA GPUs (compressed on their GPU by the daemon), of
            any dtype.
        path: the file to create or replace (its folder must exist).
        codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (docs/format.md); non-float tensors get 'bytes' under
            'fast' and 'max'.
        client: the daemon client; None: the process's default client (``tzip._default``).
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
    stored = sorted(enc.stored, key=_alignment_rank)  # stable: tree order within one element size
    header_bytes, _ = encode_safetensors_header([(s.name, s.st_dtype, s.file_shape, s.nbytes) for s in stored], metadata)
    by_name = {s.name: s for s in stored}
    data_length = sum(s.nbytes for s in stored)
    c = resolve_client(client, strict) if stored else None
    with atomic_file(path) as fd:
        writer = ContainerWriter(fd, header_bytes, data_length, path)

        def submit(batch: list[Entry]):
            views = [codec_view(by_name[e.name].tensor, e.dtype, e.shape) for e in batch]
            return c.compress_async(views, codec=codec), views

        batches = _batches(writer.entries)
        pending = submit(batches[0]) if batches else None
        for k in range(len(batches)):
            fut, _views = pending
            cts = fut.result()
            pending = submit(batches[k + 1]) if k + 1 < len(batches) else None
            for ct in cts:
                writer.write_frame(ct.payload if ct.payload.device.type == "cpu" else ct.payload.cpu())
        return writer.finish()


# --------------------------------------------------------------------------------------------- loading


def _compressed(entry: Entry, frame: torch.Tensor) -> CompressedTensor:
    from ._frame import read_header

    h = read_header(frame)
    dtype = torch_dtype_of(entry.dtype)
    assert dtype is not None  # every codec dtype has a torch twin
    return CompressedTensor(frame, dtype, entry.shape, h.codec, h.nbytes)


def _daemon_error(e: Exception, reader: ContainerReader, entries: list[Entry]) -> Exception:
    from ._errors import TzipDaemonError

    if isinstance(e, TzipDaemonError) and e.code in ("TZIP_CORRUPT", "TZIP_TRUNCATED", "TZIP_CHECKSUM", "TZIP_UNSUPPORTED"):
        e_at = entries[e.index] if e.index is not None and 0 <= e.index < len(entries) else None
        return ContainerError(e.code, e.detail, reader.path, e_at.name if e_at is not None else None)
    if isinstance(e, ValueError) and "invalid tzip frame" in str(e):  # raw frames are checked here, not by the daemon
        return ContainerError("TZIP_CHECKSUM" if "digest" in str(e) or "checksum" in str(e) else "TZIP_CORRUPT", str(e),
                              reader.path, entries[0].name if len(entries) == 1 else None)
    return e


def decode_entries(reader: ContainerReader, entries: list[Entry], client: Client | None,
                   devices: Callable[[Entry], torch.device] | None = None,
                   outs: Callable[[Entry], torch.Tensor | None] | None = None,
                   strict: bool = False) -> Iterator[tuple[Entry, torch.Tensor]]:
    """Decodes ``entries`` of ``reader``, yielding ``(entry, tensor)`` in order; each tensor has the entry's codec
    dtype and shape (decode into ``outs(entry)`` when that gives a tensor of that dtype and shape), on
    ``devices(entry)`` (default CPU). Frames are read in batches of about 64 MiB, the next batch read while the
    daemon decodes the current one; every chunk digest is checked.

    Raises ContainerError (TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, TZIP_UNSUPPORTED) naming the file and
    tensor; DaemonUnavailableError for compressed frames when no daemon can decode them.
    """
    batches = _batches(entries)
    if not batches:
        return
    c = None

    def submit(batch: list[Entry]):
        nonlocal c
        cts = []
        targets = []
        for e in batch:
            frame = reader.read_frame(e)
            ct = _compressed(e, frame)
            dev = devices(e) if devices is not None else torch.device("cpu")
            if dev.type != "cpu":
                ct = CompressedTensor(frame.to(dev), ct.dtype, ct.shape, ct.codec, ct.nbytes)
            cts.append(ct)
            o = outs(e) if outs is not None else None
            targets.append(o)
        if c is None:
            c = resolve_client(client, strict) if any(ct.codec != "raw" for ct in cts) or client is not None else None
        if c is None:  # raw frames only: decoded here, no daemon needed
            from concurrent.futures import Future

            fut: Future = Future()
            try:
                fut.set_result([_decode_raw_here(ct, o) for ct, o in zip(cts, targets)])
            except Exception as e:  # noqa: BLE001 (re-raised by result())
                fut.set_exception(e)
            return fut, batch
        return c.decompress_async(cts, out=targets), batch

    pending = submit(batches[0])
    for k in range(len(batches)):
        fut, batch = pending
        try:
            tensors = fut.result()
        except Exception as e:
            raise _daemon_error(e, reader, batch) from None
        pending = submit(batches[k + 1]) if k + 1 < len(batches) else None
        yield from zip(batch, tensors)


def _decode_raw_here(ct: CompressedTensor, out: torch.Tensor | None) -> torch.Tensor:
    """A raw frame decoded in this process (checked), without a daemon (the Client's own raw path)."""
    from ._dlpack import copy_from_bytes, from_bytes
    from ._frame import decode_raw, read_header

    frame = ct.payload.detach().cpu().contiguous()
    body = decode_raw(frame, read_header(frame), True)
    flat = body.clone() if body.numel() else torch.empty(0, dtype=torch.uint8)
    host = from_bytes(flat, ct.dtype, ct.shape)
    if out is not None:
        if out.device.type == "cpu":
            copy_from_bytes(out, flat)
        else:
            out.copy_(host.to(out.device)) if host.numel() else None
        return out
    dev = ct.payload.device
    return host if dev.type == "cpu" else host.to(dev)


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
            raise RuntimeError(f"a tensor was saved on {location}, but torch.cuda.is_available() is False: pass "
                               "map_location='cpu' (or a dict or callable) to tzip.load")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"a tensor was saved on {location}, this machine has {torch.cuda.device_count()} CUDA "
                               "device(s): pass map_location to tzip.load")
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
    st = SAFETENSORS_DTYPES.get(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return dtype, shape, st or "U8", shape if st else (nbytes,)


def _as_tensor(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The decoded codec-layout tensor ``flat`` seen as ``dtype`` and ``shape`` (bytes reinterpreted, no copy)."""
    if flat.dtype == dtype and tuple(flat.shape) == shape:
        return flat
    if flat.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=flat.device)
    u8 = int_alias(flat).contiguous().view(torch.uint8).reshape(-1)
    return u8.view(dtype).reshape(shape)


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
        if TREE_KEY in meta:
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
        for e, flat in decode_entries(reader, entries, client,
                                      devices=lambda e: devices[e.name] or torch.device("cpu"), strict=strict):
            dtype, shape, loc = layout[e.name]
            t = _as_tensor(flat, dtype, shape)
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
