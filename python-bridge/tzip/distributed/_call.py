"""What every tzip.distributed call shares: the header exchanged before any data moves (dtype, shape, frame sizes
and codecs, op, status), the per-call state (:class:`_Call`: group, wire device, codec, client, traffic, the error
a rank's preparation raised), the traffic counters, the reduction ops and the byte views of tensors. The call kinds
themselves are in :mod:`._p2p`, :mod:`._collectives` and :mod:`._all_reduce`.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .._codec_choice import check_codec
from .._default import resolve_client
from .._dlpack import int_alias
from .._generated_constants import CODEC_IDS
from ..client import Client, _stream_tag, tagged
from ..compressed import CompressedTensor

ReduceOp = dist.ReduceOp

class MismatchError(ValueError):
    """The ranks of one call disagree (dtype, shape, op, source rank, or which call they are in). Raised on every
    rank of the call with the same message, before any tensor data moves."""


# --- counters ---------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes of one call kind, as this rank counts them.

    ``bytes_raw``: bytes of tensor data the calls carried between this rank and the others, uncompressed, counted
    once per destination (recv: once per message received); what the same call of plain torch.distributed moves
    (all_reduce: ``2 * (n-1)/n * nbytes``, as a ring all-reduce sends). ``bytes_sent``: the bytes this rank really
    sent for the same data (recv: received), frames (or the raw bytes, codec="raw") plus the call's headers (a
    send/recv counts both sides' headers). ``calls``: how many calls. All in bytes.
    """

    calls: int = 0
    bytes_raw: int = 0
    bytes_sent: int = 0

    @property
    def ratio(self) -> float:
        """bytes_sent / bytes_raw (lower is better); NaN when nothing was counted."""
        return self.bytes_sent / self.bytes_raw if self.bytes_raw else math.nan

    def add(self, other: "Traffic") -> None:
        self.calls += other.calls
        self.bytes_raw += other.bytes_raw
        self.bytes_sent += other.bytes_sent


_counters_lock = threading.Lock()
_counters: dict[str, Traffic] = {}


def _record(kind: str, t: Traffic) -> None:
    with _counters_lock:
        _counters.setdefault(kind, Traffic()).add(t)


def counters(reset: bool = False) -> dict[str, Traffic]:
    """This process's :class:`Traffic` per call kind ("send", "recv", "broadcast", "all_gather", "reduce_scatter",
    "all_reduce"; the DDP hook's all-reduces count under "all_reduce"), as a snapshot. ``reset=True`` zeroes them
    after taking it."""
    with _counters_lock:
        snap = {k: Traffic(v.calls, v.bytes_raw, v.bytes_sent) for k, v in _counters.items()}
        if reset:
            _counters.clear()
    return snap


# --- headers ----------------------------------------------------------------------------------------

_MAGIC = 0x545A_4443_0001  # "TZDC", header layout 1
_KINDS = {"send": 1, "recv": 2, "broadcast": 3, "all_gather": 4, "reduce_scatter": 5, "all_reduce": 6}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_OK, _FAILED = 0, 1

# Frame codecs on the wire: the frame's codec id (docs/format.md) + 1, since 0 is PLAIN, a tensor's own bytes
# (codec="raw": no frame, no daemon).
_PLAIN = 0
_CODEC_IDS = {name: code + 1 for name, code in CODEC_IDS.items()}
_CODEC_NAMES = {v: k for k, v in _CODEC_IDS.items()}

# dtype codes: positions in this list (append only; both ranks run the same table).
_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
                "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8",
                "bits16")
_DTYPE_CODE: dict[torch.dtype, int] = {}
for _i, _n in enumerate(_DTYPE_NAMES):
    _d = getattr(torch, _n, None)
    if isinstance(_d, torch.dtype):
        _DTYPE_CODE[_d] = _i + 1
_DTYPE_OF = {v: k for k, v in _DTYPE_CODE.items()}

_SHOWN_DIMS = 8  # dims kept in a header for messages; equality uses ndim, numel and a digest of the whole shape
_DESC_LEN = 4 + _SHOWN_DIMS
# header: magic, kind, status, world size, desc, aux0 (op or source rank), aux1 (layout digest), then (size, codec)
# per frame slot
_H_KIND, _H_STATUS, _H_WORLD, _H_DESC, _H_AUX = 1, 2, 3, 4, 4 + _DESC_LEN
_H_FRAMES = _H_AUX + 2


def _digest(values: Sequence[int]) -> int:
    """63 bits of BLAKE2b over int64 values (fits an int64 header slot, never negative)."""
    data = struct.pack(f"<{len(values)}q", *values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        raise TypeError(f"tzip.distributed does not carry {dtype} tensors (dtypes: {', '.join(_DTYPE_NAMES)})")
    return code


def _desc(t: torch.Tensor) -> list[int]:
    """dtype code, ndim, numel, shape digest, the first dims (-1 beyond ndim)."""
    dims = [int(d) for d in t.shape]
    shown = (dims + [-1] * _SHOWN_DIMS)[:_SHOWN_DIMS]
    return [_dtype_code(t.dtype), len(dims), math.prod(dims), _digest(dims), *shown]


def _show(desc: Sequence[int]) -> str:
    code, ndim = desc[0], desc[1]
    dims = ", ".join(str(d) for d in desc[4 : 4 + min(ndim, _SHOWN_DIMS)]) + (", ..." if ndim > _SHOWN_DIMS else "")
    return f"{_DTYPE_OF.get(code, f'dtype #{code}')} [{dims}]"


def _key(desc: Sequence[int]) -> tuple[int, ...]:
    return tuple(desc[:4])


@dataclass
class _Head:
    """One rank's header, parsed."""

    magic: int
    kind: int
    status: int
    world: int
    desc: list[int]
    aux0: int
    aux1: int
    frames: list[tuple[int, int]]  # (bytes, codec id) per slot

    @classmethod
    def parse(cls, row: Sequence[int]) -> "_Head":
        f = row[_H_FRAMES:]
        return cls(row[0], row[_H_KIND], row[_H_STATUS], row[_H_WORLD], list(row[_H_DESC : _H_DESC + _DESC_LEN]),
                   row[_H_AUX], row[_H_AUX + 1], [(f[i], f[i + 1]) for i in range(0, len(f), 2)])


def _header(kind: str, status: int, world: int, desc: Sequence[int] | None, aux0: int, aux1: int,
            frames: Sequence[tuple[int, int]], slots: int) -> list[int]:
    desc = list(desc) if desc is not None else [0] * _DESC_LEN
    row = [_MAGIC, _KINDS[kind], status, world, *desc, aux0, aux1]
    for i in range(slots):
        row.extend(frames[i] if i < len(frames) else (0, _PLAIN))
    return row


def _header_len(slots: int) -> int:
    """Ints in a header of ``slots`` frame slots: 1 for send/recv, the world size for every collective (so that ranks
    in different collectives still exchange rows of one length, and learn it from the kind)."""
    return _H_FRAMES + 2 * slots


# --- ops --------------------------------------------------------------------------------------------

_OP_NAMES = {int(ReduceOp.SUM): "SUM", int(ReduceOp.AVG): "AVG", int(ReduceOp.PRODUCT): "PRODUCT",
             int(ReduceOp.MIN): "MIN", int(ReduceOp.MAX): "MAX"}
_SUM, _AVG, _PRODUCT, _MIN, _MAX = (int(ReduceOp.SUM), int(ReduceOp.AVG), int(ReduceOp.PRODUCT), int(ReduceOp.MIN),
                                    int(ReduceOp.MAX))
_op_checked: set[tuple[int, torch.dtype]] = set()


def _op_code(op) -> int:
    red = getattr(op, "op", op)  # a ReduceOp instance carries its RedOpType in .op
    try:
        code = int(red)
    except (TypeError, ValueError):
        raise ValueError(f"op {op!r} is not a torch.distributed.ReduceOp") from None
    if code not in _OP_NAMES:
        raise ValueError(f"op {red}: tzip.distributed reduces with SUM, AVG, PRODUCT, MIN or MAX only")
    return code


def _combine(code: int, acc: torch.Tensor, x: torch.Tensor) -> None:
    """acc = acc op x, in place, in acc's dtype (AVG's steps are SUM's)."""
    if code in (_SUM, _AVG):
        acc.add_(x)
    elif code == _PRODUCT:
        acc.mul_(x)
    elif code == _MIN:
        torch.minimum(acc, x, out=acc)
    else:
        torch.maximum(acc, x, out=acc)


def _check_op(code: int, dtype: torch.dtype, device: torch.device) -> None:
    """TypeError now, before any data moves, when the op is not defined for the dtype."""
    if (code, dtype) in _op_checked:
        return
    if code == _AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"AVG of {dtype} is not defined (tzip.distributed averages floating and complex tensors only: "
                        "use SUM and divide as you see fit)")
    try:
        a = torch.zeros(1, dtype=dtype, device=device)
        _combine(code, a, torch.zeros(1, dtype=dtype, device=device))
        if code == _AVG:
            a.div_(2)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise TypeError(f"{_OP_NAMES[code]} is not defined for {dtype} tensors here: {e}") from None
    _op_checked.add((code, dtype))


# --- bytes ------------------------------------------------------------------------------------------


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The C-order bytes of ``t`` as a 1-D uint8 tensor on its device (a view when ``t`` is contiguous)."""
    t = t.detach()
    return int_alias(t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)


def _copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src bit for bit (same dtype and numel; through integer views: NaN payloads stay)."""
    if dst.numel() == 0:
        return
    d = int_alias(dst)
    d.copy_(int_alias(src).reshape(d.shape))


def _aligned(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``data`` where a view as ``itemsize``-byte elements may start (a copy when a peer's frames left it unaligned)."""
    return data if data.storage_offset() % itemsize == 0 else data.clone()


def _fill_from_bytes(dst: torch.Tensor, data: torch.Tensor) -> None:
    """dst's values from C-order bytes ``data`` (1-D uint8, any device)."""
    if dst.numel() == 0:
        return
    d = int_alias(dst)
    d.copy_(_aligned(data, d.element_size()).view(d.dtype).reshape(d.shape))


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over C-order bytes ``data`` (a view when aligned)."""
    if data.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=data.device)
    return _aligned(data, dtype.itemsize).view(dtype).reshape(tuple(shape))


def _shards(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of the n shards of a flat tensor (the first numel % n have one element more)."""
    q, r = divmod(numel, n)
    out, start = [], 0
    for k in range(n):
        end = start + q + (1 if k < r else 0)
        out.append((start, end))
        start = end
    return out


# --- one call ---------------------------------------------------------------------------------------


@dataclass
class _Wire:
    """What goes on the wire for one tensor: a 1-D uint8 tensor (on the wire device) and its codec id."""

    data: torch.Tensor
    codec: int


def _wire_device(group, data: torch.device) -> torch.device:
    """Where headers and frames travel: the CUDA device for NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    nccl = "nccl" in backend
    cpu_ok = "gloo" in backend or not nccl
    if nccl and (data.type == "cuda" or not cpu_ok):
        return data if data.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Call:
    """The state of one call: group, ranks, wire device, codec, client (resolved when first needed), traffic."""

    def __init__(self, kind: str, group, like, codec: str | None, client: Client | None, strict: bool):
        """``like``: the call's tensor (its device is where results go; anything else: the CPU, and the call's
        preparation raises TypeError on every rank)."""
        if not dist.is_initialized():
            raise RuntimeError(f"tzip.distributed.{kind}: torch.distributed is not initialised "
                               "(call torch.distributed.init_process_group first)")
        self.kind = kind
        self.group = group if group is not None else dist.group.WORLD
        self.me = dist.get_rank(self.group)
        self.n = dist.get_world_size(self.group)
        self.device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
        self.wire = _wire_device(self.group, self.device) if self.me >= 0 else torch.device("cpu")
        self.codec = codec
        self._client = client
        self.strict = strict
        self.traffic = Traffic(calls=1)
        # what this rank's preparation raised (attempt); kept on the call rather than in the functions' locals so
        # that raising it forms no reference cycle (raise_own)
        self.error: BaseException | None = None
        # the daemon counts the call's requests under this stream of the job: the caller's tag (the DDP hook:
        # gradients), else sendrecv; read here, in the caller's thread (isend/irecv run on a worker thread)
        self.stream = _stream_tag.get() or "sendrecv"

    @property
    def member(self) -> bool:
        return self.me >= 0

    def check_codec(self) -> None:
        """ValueError for an unknown codec (called while preparing, so the other ranks hear of it)."""
        check_codec(self.codec)

    def resolve_codec(self) -> None:
        """The codec the job's settings ask for, on a rank about to encode: "raw" (plain bytes, no daemon) once
        ``tzip set JOB codec=off`` reached this rank's client (Client.job_codec). Ranks may learn that at different
        calls: every rank's frames carry their own codec, so a call with some ranks plain and others compressed is
        still lossless."""
        if self.codec != "raw":
            c = self.client()
            if isinstance(c, Client):  # an object with compress/decompress only has no job settings
                self.codec = c.job_codec(self.codec)

    def client(self) -> Client:
        if self._client is None:
            self._client = resolve_client(None, self.strict)
        return self._client

    def wire_buffer(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``nbytes`` on the wire device. Page-locked when the wire is the host and
        the call's tensors are on a GPU (gloo carrying CUDA tensors): the copies between the GPU and it then run at
        PCIe speed instead of through a pageable bounce, and PyTorch's caching host allocator keeps the pages from one
        call to the next."""
        pin = self.wire.type == "cpu" and self.device.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, device=self.wire, pin_memory=pin)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the wire device (itself when it is there; a GPU tensor's copy into page-locked host memory)."""
        if t.device == self.wire:
            return t
        if self.wire.type == "cpu" and t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)  # (not non_blocking: the bytes are read on the host next)
            return host
        return t.to(self.wire)

    # encode / decode ------------------------------------------------------------------------------
    def encode(self, parts: list[torch.Tensor]) -> list[_Wire]:
        """Frames of ``parts`` (one client request), or their bytes for codec="raw"."""
        if self.codec == "raw":
            return [_Wire(self.to_wire(_bytes_of(p)), _PLAIN) for p in parts]
        if not parts:
            return []
        self.resolve_codec()
        if self.codec == "raw":
            return [_Wire(self.to_wire(_bytes_of(p)), _PLAIN) for p in parts]
        with tagged(self.stream):
            cts = self.client().compress(list(parts), self.codec)
        payloads = [ct.payload for ct in cts]
        if payloads[0].device != self.wire:
            if len(payloads) > 1:  # one copy to the wire device instead of one per frame
                joined = self.to_wire(torch.cat(payloads))
                payloads = list(joined.split([p.numel() for p in payloads]))
            else:
                payloads = [self.to_wire(payloads[0])]
        return [_Wire(p, _CODEC_IDS[ct.codec]) for p, ct in zip(payloads, cts)]

    def decode(self, wires: list[_Wire], like: list[tuple[torch.dtype, torch.Size]],
               outs: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Tensors of ``like``'s dtypes and shapes from ``wires``: written into ``outs[i]`` when given, else new
        tensors on the call's device (all frames in one client request)."""
        results: list[torch.Tensor | None] = [None] * len(wires)
        frames, frame_outs, frame_idx = [], [], []
        for i, (w, (dtype, shape), o) in enumerate(zip(wires, like, outs)):
            if w.codec == _PLAIN:
                if o is not None:
                    _fill_from_bytes(o, w.data)
                    results[i] = o
                else:
                    t = _from_bytes(w.data, dtype, shape)
                    results[i] = t if t.device == self.device else t.to(self.device)
                continue
            name = _CODEC_NAMES.get(w.codec)
            if name is None:
                raise MismatchError(f"tzip.distributed.{self.kind}: a peer sent frames of unknown codec id {w.codec}")
            nbytes = math.prod(shape) * dtype.itemsize
            frames.append(CompressedTensor(w.data, dtype, shape, name, nbytes))
            if o is None and self.device != self.wire:
                o = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            frame_outs.append(o)
            frame_idx.append(i)
        if frames:
            with tagged(self.stream):
                done = self.client().decompress(frames, out=frame_outs)
            for i, t in zip(frame_idx, done):
                results[i] = t
        return results  # type: ignore[return-value]

    # headers ----------------------------------------------------------------------------------------
    def exchange(self, row: list[int]) -> list[_Head]:
        """All ranks' headers (all_gather_into_tensor of int64 rows), first checked for the same call."""
        mine = torch.tensor(row, dtype=torch.int64)
        if self.wire.type != "cpu":
            mine = mine.to(self.wire)
        out = torch.empty(self.n * len(row), dtype=torch.int64, device=self.wire)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        self.traffic.bytes_sent += len(row) * 8 * (self.n - 1)
        heads = [_Head.parse(r) for r in out.view(self.n, len(row)).cpu().tolist()]
        self.check_call(heads)
        return heads

    def check_call(self, heads: list[_Head]) -> None:
        name = f"tzip.distributed.{self.kind}"
        odd = [r for r, h in enumerate(heads) if h.magic != _MAGIC]
        if odd:
            raise MismatchError(f"{name}: rank(s) {odd} sent no tzip.distributed header: the ranks are not in the same "
                                "call (a plain torch.distributed call on one rank?)")
        kinds = {r: _KIND_NAMES.get(h.kind, f"#{h.kind}") for r, h in enumerate(heads)}
        if len(set(kinds.values())) > 1:
            raise MismatchError("tzip.distributed: the ranks are in different calls: " +
                                ", ".join(f"rank {r}: {k}" for r, k in kinds.items()))

    def attempt(self, fn: Callable[[], object]):
        """fn()'s value; or None, keeping what it raised in ``error`` (the call still takes part in the header
        exchange, marked failed, and raises it after that)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - raised by raise_own after the exchange
            self.error = e
            return None

    @property
    def status(self) -> int:
        """The header's status: _FAILED once attempt() caught an error, else _OK."""
        return _OK if self.error is None else _FAILED

    def raise_own(self) -> None:
        """Raises the error attempt() kept, if any, and forgets it.

        Why not ``raise err`` from a local: the error's traceback holds the frames it passes through, and a frame
        that also holds the error in a local makes a cycle that only the garbage collector frees. Until it runs, the
        cycle keeps this call and its process group alive, so ``destroy_process_group()`` cannot free the group and
        gloo's threads outlive it; one of them then takes the GIL during interpreter shutdown and the process dies
        with "terminate called without an active exception" (SIGABRT) at exit."""
        err, self.error = self.error, None
        if err is not None:
            try:
                raise err
            finally:
                del err

    def raise_failed(self, heads: list[_Head]) -> None:
        """This rank's own error, else a RuntimeError naming the ranks that failed before the exchange."""
        self.raise_own()
        failed = [r for r, h in enumerate(heads) if h.status != _OK]
        if failed:
            raise RuntimeError(f"tzip.distributed.{self.kind}: rank(s) {failed} of the group failed before the "
                               "exchange (the error is raised there); nothing was sent")

    def done(self) -> None:
        _record(self.kind, self.traffic)


def _slots(w: _Wire | None) -> list[tuple[int, int]]:
    """The header's frame slot of one wire tensor (none when the preparation failed)."""
    return [(w.data.numel(), w.codec)] if w is not None else []


def _desc_or_none(t: torch.Tensor) -> list[int] | None:
    try:
        return _desc(t)
    except Exception:  # noqa: BLE001 - the same error is raised by the preparation step
        return None


def _check_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise TypeError(f"{what}: only dense (strided) tensors are carried, not {t.layout}"
                        f"{' (quantized)' if t.is_quantized else ''}{' (meta)' if t.is_meta else ''}")
    _dtype_code(t.dtype)
