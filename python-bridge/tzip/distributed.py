"""Lossless compressed collectives over torch.distributed.

Each call compresses what it sends through the tzip daemon (:func:`tzip._default.resolve_client`: CPU tensors
through shared memory, CUDA tensors through CUDA IPC) and decompresses what arrives, bit for bit. The transport is
torch.distributed itself (gloo on the CPU, NCCL on GPUs; no transport of our own)::

    import tzip.distributed as tzd
    tzd.all_reduce(grad)                          # in place, like dist.all_reduce; returns grad
    tzd.broadcast(weight, src=0)
    tzd.send(t, dst=1); tzd.recv(t, src=0)        # or isend/irecv(...).wait()
    tzd.counters()                                # bytes before and after compression, per call kind

Every call first exchanges a small header (int64: dtype, shape, the sizes and codecs of the frames, the op): the
ranks check that they agree before any data moves, and a dtype, shape or size mismatch raises
:class:`MismatchError` on every rank of the call, with the same message, instead of a partial fill or a hang. A
rank that fails before the exchange (an unsupported dtype, a strict client without a daemon) says so in its header:
it raises its own error and the other ranks raise RuntimeError naming it.

``all_reduce`` is a lossless compressed all-reduce:

1. the tensor is flattened and split into ``world_size`` shards (shard k: elements ``[k*q + min(k, r), ...)`` with
   ``q, r = divmod(numel, world_size)``; the first r shards have one element more);
2. rank i compresses every shard but its own (one client request) and, after the header exchange, sends shard j
   to rank j with one ``all_to_all_single``;
3. rank j decompresses the n-1 shards it received and reduces the n shards **in rank order 0, 1, ..., n-1**
   (``((s0 op s1) op s2) ...``, each step one torch op in the tensor's dtype), so every rank's result is the same
   whatever arrived first;
4. rank j compresses its reduced shard; the sizes are gathered, then every rank sends its frame to every other
   (``all_to_all_single``: frames of different sizes travel unpadded);
5. every rank decompresses the n-1 reduced shards of the others into the tensor.

With ``codec="raw"`` the same steps run with the tensors' bytes in place of frames (no daemon involved): that is the
uncompressed reference, and every codec's result is bit-identical to it. Where the order cannot matter (two ranks:
``a + b == b + a`` in IEEE arithmetic) the result is also bit-identical to ``dist.all_reduce``, NaNs aside: a NaN
stays a NaN, but its bits are the arithmetic's choice (x86 keeps the first operand's payload; torch's vectorised
bf16 add writes 0xFFFF where gloo's scalar one writes 0x7FC0), and gloo's MIN and MAX may drop a NaN that
``torch.minimum``/``maximum`` keep. With more ranks ``dist.all_reduce`` reduces in the backend's own order (gloo's
ring) and may differ from both in the last bits.

Ops (``ReduceOp``), each step one torch op in the tensor's dtype:

* SUM, PRODUCT, MIN, MAX: ``add_``, ``mul_``, ``minimum``, ``maximum`` (a NaN wins MIN and MAX), for every dtype torch
  has them for; on bool SUM is logical or and PRODUCT logical and (gloo's own bool SUM adds the bytes: True + True
  stores 2 there). A complex product's last bit depends on whether torch multiplies the element in a vector lane or
  in the scalar tail, so it follows the shard boundaries: the same on every rank and for every codec, not always
  the same as one product of whole tensors.
* AVG, floating and complex dtypes only: the SUM in rank order, then one ``div_(world_size)``. (gloo has no AVG;
  NCCL's may round differently.)
* BAND, BOR, BXOR and PREMUL_SUM raise ValueError; an op the dtype lacks (MIN of complex, SUM of uint32, anything of
  float8) raises TypeError; both on every rank, before any data moves.

Dtypes carried: bool, (u)int8/16/32/64, float16, bfloat16, float32, float64, complex32/64/128, the float8 dtypes,
float4_e2m1fn_x2, bits8, bits16.

Wire and devices: headers and frames travel on the CPU for gloo (a CUDA tensor's frames are copied to the host and
back) and on the current CUDA device for NCCL. Point-to-point messages are matched by tags derived from a per-peer
sequence number (gloo); NCCL ignores tags, so there isend/irecv run one at a time in call order and both ranks must
post them in the same order (as NCCL requires anyway). A send completes when the receiver has answered its header
(as MPI's synchronous send): two ranks that both call the blocking ``send`` first wait for each other; use isend.

Empty and 0-dim tensors work in every call (a 0-dim tensor is one element). Tensors may be non-contiguous (values in
C order; results are written back into the tensor). Receivers need a daemon to decode frames other than ``raw``;
when the daemon is away a lenient client sends raw frames (and warns once), so peers on that machine need none.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ._default import resolve_client
from ._dlpack import int_alias
from ._codec_choice import check_codec
from .client import Client, _stream_tag, tagged
from .compressed import CompressedTensor

__all__ = [
    "ReduceOp",
    "MismatchError",
    "Work",
    "Traffic",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "counters",
]

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

# Frame codecs on the wire; PLAIN is a tensor's own bytes (codec="raw": no frame, no daemon).
_PLAIN = 0
_CODEC_IDS = {"raw": 1, "fast": 2, "max": 3, "bytes": 4}
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

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.wire else t.to(self.wire)

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
                joined = torch.cat(payloads).to(self.wire)
                payloads = list(joined.split([p.numel() for p in payloads]))
            else:
                payloads = [payloads[0].to(self.wire)]
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


# --- point to point ---------------------------------------------------------------------------------

_TAG_BASE = 0x2A00_0000  # far from the small tags programs give their own messages
_TAG_SEQS = 1 << 20
_seq_lock = threading.Lock()
_seqs: dict[tuple[str, int, str], int] = {}
_fifo: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _group_key(group) -> str:
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", id(g)))


def _next_seq(group, peer: int, way: str) -> int:
    key = (_group_key(group), peer, way)
    with _seq_lock:
        s = _seqs.get(key, 0)
        _seqs[key] = s + 1
    return s


def _tag(seq: int, part: int) -> int:
    """part 0: the sender's header, 1: the receiver's header, 2: the payload."""
    return _TAG_BASE + (seq % _TAG_SEQS) * 4 + part


class Work:
    """A pending :func:`isend` or :func:`irecv`. ``wait(timeout=None)`` returns the received tensor (irecv) or None
    (isend) once the message is done, and raises what the operation raised (MismatchError, ...)."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def wait(self, timeout: float | None = None):
        """Blocks until done (``timeout`` seconds at most: then concurrent.futures.TimeoutError)."""
        future = self._future
        try:
            return future.result(timeout)
        finally:
            del self, future  # the error's traceback holds this frame: no cycle back to it (_Call.raise_own)

    def is_completed(self) -> bool:
        return self._future.done()


def _start(group, fn: Callable[[], object], device: torch.device) -> Work:
    """Runs ``fn`` off the caller's thread: a thread per message on gloo (tags keep messages apart), one FIFO thread
    per group on NCCL (messages matched by order). CUDA work runs on the caller's current stream."""
    work = Work()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    g = group if group is not None else dist.group.WORLD
    if "nccl" in str(dist.get_backend(g)).lower():
        key = _group_key(g)
        with _seq_lock:
            ex = _fifo.get(key)
            if ex is None:
                ex = _fifo[key] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tzip-p2p")
        ex.submit(_run, work._future, fn, stream)
    else:
        threading.Thread(target=_run, args=(work._future, fn, stream), name="tzip-p2p", daemon=True).start()
    return work


def _run(future: concurrent.futures.Future, fn: Callable[[], object], stream) -> None:
    """_start's worker: fn()'s value or exception into ``future`` (on ``stream`` when not None)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        if stream is not None:
            with torch.cuda.stream(stream):
                value = fn()
        else:
            value = fn()
    except BaseException as e:  # noqa: BLE001 - handed to wait()
        future.set_exception(e)
        future = None  # the error's traceback holds this frame: no cycle through the future (_Call.raise_own)
    else:
        future.set_result(value)


_P2P_SLOTS = 1


def _p2p_mismatch(s_rank: int, s_desc, r_rank: int, r_desc) -> MismatchError:
    return MismatchError(f"tzip.distributed.send/recv: rank {s_rank} sends {_show(s_desc)}, rank {r_rank} receives "
                         f"into {_show(r_desc)}; nothing was copied")


def _p2p(kind: str, tensor, peer: int, group, codec: str | None, client: Client | None, strict: bool, body) -> Work:
    """A :class:`Work` running ``body(call, seq)`` off the caller's thread, with this message's sequence number."""
    call = _Call(kind, group, tensor, codec, client, strict)
    if not call.member:  # as torch.distributed: a rank outside the group takes no part
        work = Work()
        work._future.set_result(None if kind == "send" else tensor)
        return work
    seq = _next_seq(call.group, peer, kind)
    return _start(call.group, lambda: body(call, seq), call.device)


def _handshake(call: _Call, peer: int, seq: int, row: list[int]) -> _Head:
    """Sends this side's header and receives the peer's (both in flight at once); raises this side's own error
    (``call.error``), or when the peer is not the matching call or failed before the transfer."""
    mine, theirs = (0, 1) if call.kind == "send" else (1, 0)  # the sender's header is part 0, the receiver's part 1
    want = "recv" if call.kind == "send" else "send"
    head = torch.empty(len(row), dtype=torch.int64, device=call.wire)
    pending = dist.irecv(head, src=peer, group=call.group, tag=_tag(seq, theirs))
    dist.send(call.to_wire(torch.tensor(row, dtype=torch.int64)), peer, group=call.group, tag=_tag(seq, mine))
    pending.wait()
    call.traffic.bytes_sent += 2 * len(row) * 8
    call.raise_own()
    got = _Head.parse(head.cpu().tolist())
    if got.magic != _MAGIC or got.kind != _KINDS[want]:
        raise MismatchError(f"tzip.distributed.{call.kind}: rank {peer} is not in tzip.distributed.{want}")
    if got.status != _OK:
        raise RuntimeError(f"tzip.distributed.{call.kind}: rank {peer} failed before the transfer (the error is raised "
                           "there); nothing was sent")
    return got


def isend(tensor: torch.Tensor, dst: int, group=None, codec: str | None = None, client: Client | None = None,
          strict: bool = False) -> Work:
    """Sends ``tensor`` (any shape, a dtype of the module docstring, CPU or CUDA) to global rank ``dst``,
    compressed with ``codec``; returns a :class:`Work` (``wait()`` -> None).

    The header goes first and the receiver answers with its own: a dtype or shape that differs from the receiving
    tensor's raises :class:`MismatchError` on both ranks. Messages to one peer are matched in the order of the calls.
    Do not modify ``tensor`` until ``wait()`` returned.

    Raises (from wait()): MismatchError; RuntimeError (the receiver failed, or torch.distributed's timeout);
    DaemonUnavailableError (``strict=True`` and no daemon); ValueError (unknown codec); TypeError (a tensor of
    another dtype or layout than carried).
    """
    return _p2p("send", tensor, dst, group, codec, client, strict, lambda call, seq: _send(call, tensor, dst, seq))


def _send(call: _Call, tensor: torch.Tensor, dst: int, seq: int) -> None:
    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        return call.encode([tensor])[0]

    w = call.attempt(prepare)
    desc = _desc_or_none(tensor) if isinstance(tensor, torch.Tensor) else None
    frames = _slots(w)
    peer = _handshake(call, dst, seq, _header("send", call.status, 0, desc, 0, 0, frames, _P2P_SLOTS))
    if _key(peer.desc) != _key(desc):
        raise _p2p_mismatch(dist.get_rank(), desc, dst, peer.desc)
    if w.data.numel():
        dist.send(w.data, dst, group=call.group, tag=_tag(seq, 2))
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size()
    call.traffic.bytes_sent += w.data.numel()
    call.done()


def irecv(tensor: torch.Tensor, src: int, group=None, client: Client | None = None, strict: bool = False) -> Work:
    """Receives into ``tensor`` from global rank ``src`` (a message sent with :func:`send`/:func:`isend`); returns a
    :class:`Work` whose ``wait()`` gives ``tensor``, filled. ``src`` is required (the header exchange names the peer).

    Raises (from wait()): MismatchError (the sender's dtype or shape differs; ``tensor`` is left as it was);
    RuntimeError (the sender failed, or torch.distributed's timeout); DaemonUnavailableError (a compressed frame and
    no daemon to decode it).
    """
    return _p2p("recv", tensor, src, group, "raw", client, strict, lambda call, seq: _recv(call, tensor, src, seq))


def _recv(call: _Call, tensor: torch.Tensor, src: int, seq: int) -> torch.Tensor:
    call.attempt(lambda: _check_tensor(tensor, "tensor"))
    desc = _desc_or_none(tensor) if isinstance(tensor, torch.Tensor) else None
    peer = _handshake(call, src, seq, _header("recv", call.status, 0, desc, 0, 0, [], _P2P_SLOTS))
    if _key(peer.desc) != _key(desc):
        raise _p2p_mismatch(src, peer.desc, dist.get_rank(), desc)
    size, codec = peer.frames[0]
    buf = torch.empty(size, dtype=torch.uint8, device=call.wire)
    if size:
        dist.recv(buf, src, group=call.group, tag=_tag(seq, 2))
    call.decode([_Wire(buf, codec)], [(tensor.dtype, tensor.shape)], [tensor])
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size()
    call.traffic.bytes_sent += size
    call.done()
    return tensor


def send(tensor: torch.Tensor, dst: int, group=None, codec: str | None = None, client: Client | None = None,
         strict: bool = False) -> None:
    """:func:`isend` and wait: returns once the receiver has the data. Raises as isend."""
    isend(tensor, dst, group, codec, client, strict).wait()


def recv(tensor: torch.Tensor, src: int, group=None, client: Client | None = None, strict: bool = False) -> torch.Tensor:
    """:func:`irecv` and wait: returns ``tensor``, filled. Raises as irecv."""
    return irecv(tensor, src, group, client, strict).wait()


# --- collectives ------------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, src: int, group=None, codec: str | None = None, client: Client | None = None,
              strict: bool = False) -> torch.Tensor:
    """Copies ``tensor`` of global rank ``src`` into ``tensor`` of every rank of ``group`` (compressed once, at
    ``src``); returns ``tensor``.

    Every rank's tensor must have src's dtype and shape, and every rank must name the same ``src``, else
    :class:`MismatchError` on every rank.
    """
    call = _Call("broadcast", group, tensor, codec, client, strict)
    if not call.member:
        return tensor

    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        g_src = dist.get_group_rank(call.group, src)
        return g_src, (call.encode([tensor])[0] if g_src == call.me else None)

    got = call.attempt(prepare)
    g_src, w = got if got is not None else (-1, None)
    frames = _slots(w)
    heads = call.exchange(_header("broadcast", call.status, call.n, _desc_or_none(tensor), src, 0,
                                  frames, call.n))
    call.raise_failed(heads)
    srcs = {h.aux0 for h in heads}
    if len(srcs) > 1:
        raise MismatchError("tzip.distributed.broadcast: the ranks name different sources: " +
                            ", ".join(f"rank {r}: src {h.aux0}" for r, h in enumerate(heads)))
    ref = heads[g_src].desc
    odd = [r for r, h in enumerate(heads) if _key(h.desc) != _key(ref)]
    if odd:
        raise MismatchError(f"tzip.distributed.broadcast: rank {src} sends {_show(ref)}; " +
                            ", ".join(f"rank {r} has {_show(heads[r].desc)}" for r in odd))
    size, codec = heads[g_src].frames[0]
    nbytes = tensor.numel() * tensor.element_size()
    if call.me == g_src:
        buf = w.data
        call.traffic.bytes_raw += nbytes * (call.n - 1)
        call.traffic.bytes_sent += size * (call.n - 1)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=call.wire)
    if size:
        dist.broadcast(buf, src=src, group=call.group)
    if call.me != g_src:
        call.decode([_Wire(buf, codec)], [(tensor.dtype, tensor.shape)], [tensor])
    call.done()
    return tensor


def _gather_frames(call: _Call, w: _Wire, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's frame (rank r's is sizes[r] bytes long; ours is ``w``): each rank sends its frame to every other
    with one all_to_all_single, so uneven frames travel without padding (gloo's all_gather is also far slower than
    its all_to_all for large buffers)."""
    n, me = call.n, call.me
    if not any(sizes):
        return [w.data if r == me else w.data[:0] for r in range(n)]
    mine = w.data.numel()
    send_sizes = [0 if r == me else mine for r in range(n)]
    recv_sizes = [0 if r == me else sizes[r] for r in range(n)]
    send = w.data if n == 2 else torch.cat([w.data] * (n - 1)) if mine else w.data
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=call.wire)
    dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=call.group)
    call.traffic.bytes_sent += mine * (n - 1)
    parts, off = [], 0
    for r in range(n):
        parts.append(w.data if r == me else out[off : off + recv_sizes[r]])
        off += recv_sizes[r]
    return parts


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, codec: str | None = None,
               client: Client | None = None, strict: bool = False) -> list[torch.Tensor]:
    """Gathers every rank's ``tensor`` into ``tensor_list`` (entry r: rank r's tensor, of its dtype and shape; the
    ranks' tensors may differ in shape); returns ``tensor_list``. Each rank's tensor is compressed once.

    A ``tensor_list`` of the wrong length, or an entry whose dtype or shape is not that of the matching rank's
    tensor, raises :class:`MismatchError` on every rank.
    """
    call = _Call("all_gather", group, tensor, codec, client, strict)
    if not call.member:
        return tensor_list

    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        for i, t in enumerate(tensor_list):
            _check_tensor(t, f"tensor_list[{i}]")
        layout = _digest([x for t in tensor_list for x in _key(_desc(t))] + [len(tensor_list)])
        return layout, call.encode([tensor])[0]

    got = call.attempt(prepare)
    layout, w = got if got is not None else (0, None)
    frames = _slots(w)
    heads = call.exchange(_header("all_gather", call.status, call.n, _desc_or_none(tensor), 0, layout,
                                  frames, call.n))
    call.raise_failed(heads)
    want = _digest([x for h in heads for x in _key(h.desc)] + [call.n])
    odd = [r for r, h in enumerate(heads) if h.aux1 != want]
    if odd:
        raise MismatchError(f"tzip.distributed.all_gather: the tensor_list of rank(s) {odd} does not match the ranks' "
                            f"tensors (entry r must have rank r's dtype and shape; {call.n} entries): " +
                            ", ".join(f"rank {r} sends {_show(h.desc)}" for r, h in enumerate(heads)))
    sizes = [h.frames[0][0] for h in heads]
    got_frames = _gather_frames(call, w, sizes)
    others = [r for r in range(call.n) if r != call.me]
    call.decode([_Wire(got_frames[r], heads[r].frames[0][1]) for r in others],
                [(tensor_list[r].dtype, tensor_list[r].shape) for r in others], [tensor_list[r] for r in others])
    _copy_bits(tensor_list[call.me], tensor)
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size() * (call.n - 1)
    call.done()
    return tensor_list


def _exchange_shards(call: _Call, heads: list[_Head], send_buf: torch.Tensor, send_sizes: list[int]) -> list[torch.Tensor]:
    """all_to_all_single: send_sizes[j] bytes of send_buf to rank j; returns what each rank sent here."""
    recv_sizes = [h.frames[call.me][0] for h in heads]
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=call.wire)
    if any(h.frames[j][0] for h in heads for j in range(call.n)):
        dist.all_to_all_single(out, send_buf, recv_sizes, send_sizes, group=call.group)
    call.traffic.bytes_sent += sum(s for j, s in enumerate(send_sizes) if j != call.me)
    parts, off = [], 0
    for s in recv_sizes:
        parts.append(out[off : off + s])
        off += s
    return parts


def _reduce_in_rank_order(code: int, parts: list[torch.Tensor], owned: list[bool], n: int) -> torch.Tensor:
    """parts[0] op parts[1] op ... in rank order (AVG: then div_(n)); the result is parts[0] when owned, else new."""
    acc = parts[0] if owned[0] else parts[0].clone()
    for x in parts[1:]:
        _combine(code, acc, x)
    if code == _AVG:
        acc.div_(n)
    return acc


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   codec: str | None = None, client: Client | None = None, strict: bool = False) -> torch.Tensor:
    """Rank j's ``output`` = input_list[j] of rank 0 op ... op input_list[j] of rank n-1, reduced in rank order (the
    module docstring defines the ops); returns ``output``. Every input_list[j] must have rank j's output dtype and
    shape, else :class:`MismatchError` on every rank. Each rank compresses its n-1 outgoing entries in one request.
    """
    call = _Call("reduce_scatter", group, output, codec, client, strict)
    if not call.member:
        return output

    def prepare():
        call.check_codec()
        code = _op_code(op)
        _check_tensor(output, "output")
        if len(input_list) != call.n:
            raise ValueError(f"input_list has {len(input_list)} tensors for a group of {call.n}")
        for i, t in enumerate(input_list):
            _check_tensor(t, f"input_list[{i}]")
        _check_op(code, output.dtype, output.device)
        layout = _digest([x for t in input_list for x in _key(_desc(t))] + [len(input_list)])
        sent = call.encode([t for j, t in enumerate(input_list) if j != call.me])
        sent.insert(call.me, _Wire(torch.empty(0, dtype=torch.uint8, device=call.wire), _PLAIN))
        return code, layout, sent

    got = call.attempt(prepare)
    code, layout, sent = got if got is not None else (0, 0, [])
    frames = [(w.data.numel(), w.codec) for w in sent]
    heads = call.exchange(_header("reduce_scatter", call.status, call.n, _desc_or_none(output), code,
                                  layout, frames, call.n))
    call.raise_failed(heads)
    _check_ops(call, heads)
    want = _digest([x for h in heads for x in _key(h.desc)] + [call.n])
    odd = [r for r, h in enumerate(heads) if h.aux1 != want]
    if odd:
        raise MismatchError(f"tzip.distributed.reduce_scatter: the input_list of rank(s) {odd} does not match the "
                            "ranks' outputs (entry j must have rank j's dtype and shape): " +
                            ", ".join(f"rank {r} receives {_show(h.desc)}" for r, h in enumerate(heads)))
    send_buf = torch.cat([w.data for w in sent]) if sent else torch.empty(0, dtype=torch.uint8, device=call.wire)
    got_parts = _exchange_shards(call, heads, send_buf, [w.data.numel() for w in sent])
    others = [r for r in range(call.n) if r != call.me]
    decoded = call.decode([_Wire(got_parts[r], heads[r].frames[call.me][1]) for r in others],
                          [(output.dtype, output.shape)] * len(others), [None] * len(others))
    parts = list(decoded)
    parts.insert(call.me, input_list[call.me].reshape(output.shape))
    owned = [r != call.me for r in range(call.n)]
    acc = _reduce_in_rank_order(code, parts, owned, call.n)
    _copy_bits(output, acc)
    call.traffic.bytes_raw += sum(t.numel() * t.element_size() for j, t in enumerate(input_list) if j != call.me)
    call.done()
    return output


def _check_ops(call: _Call, heads: list[_Head]) -> None:
    ops = {h.aux0 for h in heads}
    if len(ops) > 1:
        raise MismatchError(f"tzip.distributed.{call.kind}: the ranks reduce with different ops: " +
                            ", ".join(f"rank {r}: {_OP_NAMES.get(h.aux0, h.aux0)}" for r, h in enumerate(heads)))


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, codec: str | None = None, client: Client | None = None,
               strict: bool = False) -> torch.Tensor:
    """Reduces ``tensor`` across the ranks of ``group``, in place (the algorithm, ops and guarantees are in the module
    docstring); returns ``tensor``.

    Args:
        tensor: any shape (0-dim and empty included), CPU or CUDA, a dtype the op is defined for.
        op: ReduceOp.SUM, AVG, PRODUCT, MIN or MAX.
        group: the process group (default: the world).
        codec: "auto" | "fast" | "max" | "bytes" (frames through the daemon) or "raw" (the tensor's own bytes, the
            uncompressed reference; no daemon); None (default): "fast" for frames coded on a GPU, "auto" on the CPU
            (tzip._codec_choice).
        client: the daemon client (default: the process-wide one, :mod:`tzip._default`).
        strict: for the default client: raise DaemonUnavailableError instead of sending raw frames when the daemon
            is away.

    Raises (on every rank of the call, before any tensor data moves): MismatchError (the ranks' dtypes, shapes or
    ops differ), ValueError (an unsupported op or codec), TypeError (the op is not defined for the dtype), and
    RuntimeError on the others when one rank failed; DaemonUnavailableError as above.
    """
    _all_reduce(tensor, op, group, codec, client, strict)
    return tensor


def _all_reduce(tensor: torch.Tensor, op, group, codec: str | None, client: Client | None, strict: bool) -> Traffic:
    """all_reduce's work; returns this call's traffic (also added to counters())."""
    call = _Call("all_reduce", group, tensor, codec, client, strict)
    if not call.member:
        return call.traffic
    n, me = call.n, call.me
    flat = None
    copied = isinstance(tensor, torch.Tensor) and not tensor.is_contiguous()

    def prepare():
        nonlocal flat
        call.check_codec()
        code = _op_code(op)
        _check_tensor(tensor, "tensor")
        _check_op(code, tensor.dtype, tensor.device)
        flat = tensor.detach().contiguous().reshape(-1)  # a view when contiguous: results land in the tensor
        bounds = _shards(flat.numel(), n)
        if n > 1 and flat.numel():
            call.resolve_codec()  # every rank encodes: plain for all shards when the job's codec is off
        if call.codec == "raw":
            # the tensor's bytes as they lie (its own shard included: all_to_all_single then needs no copy)
            sent = [_Wire(call.to_wire(_bytes_of(flat[a:b])), _PLAIN) for a, b in bounds]
        else:
            sent = call.encode([flat[a:b] for j, (a, b) in enumerate(bounds) if j != me])
            sent.insert(me, _Wire(torch.empty(0, dtype=torch.uint8, device=call.wire), _PLAIN))
        return code, bounds, sent

    got = call.attempt(prepare)
    code, bounds, sent = got if got is not None else (0, [], [])
    frames = [(w.data.numel(), w.codec) for w in sent]
    # aux1 = 1: this rank sends plain bytes (codec="raw"), so its reduced shard's size is known without asking
    heads = call.exchange(_header("all_reduce", call.status, n, _desc_or_none(tensor), code,
                                  int(call.codec == "raw"), frames, n))
    call.raise_failed(heads)
    _check_ops(call, heads)
    ref = heads[0].desc
    odd = [r for r, h in enumerate(heads) if _key(h.desc) != _key(ref)]
    if odd:
        raise MismatchError("tzip.distributed.all_reduce: the ranks' tensors differ: " +
                            ", ".join(f"rank {r}: {_show(h.desc)}" for r, h in enumerate(heads)))
    if flat.numel() == 0:
        call.done()
        return call.traffic
    itemsize = tensor.element_size()
    mine_a, mine_b = bounds[me]
    shard_shape = torch.Size([mine_b - mine_a])

    # 2. exchange: shard j of every rank to rank j
    if call.codec == "raw":
        send_buf = call.to_wire(_bytes_of(flat))
    else:
        send_buf = torch.cat([w.data for w in sent])
    got_parts = _exchange_shards(call, heads, send_buf, [w.data.numel() for w in sent])
    call.traffic.bytes_raw += (flat.numel() - (mine_b - mine_a)) * itemsize

    # 3. decompress and reduce in rank order; 4. compress the reduced shard
    others = [r for r in range(n) if r != me]
    own = flat[mine_a:mine_b]
    all_plain = all(h.aux1 == 1 for h in heads)  # every rank sends plain bytes: the sizes are the shards'

    def reduce_and_encode():
        decoded = call.decode([_Wire(got_parts[r], heads[r].frames[me][1]) for r in others],
                              [(tensor.dtype, shard_shape)] * len(others), [None] * len(others))
        parts = list(decoded)
        parts.insert(me, own)
        # every part may be overwritten: decoded ones are ours (fresh tensors, or regions of the receive buffer that
        # are read once), and our own shard of the tensor gets the result anyway
        acc = _reduce_in_rank_order(code, parts, [True] * n, n)
        if n == 1:
            return acc, None
        return acc, _Wire(call.to_wire(_bytes_of(acc)), _PLAIN) if all_plain else call.encode([acc])[0]

    got = call.attempt(reduce_and_encode)
    acc, red = got if got is not None else (None, None)
    if all_plain or n == 1:
        call.raise_own()  # plain bytes, no daemon: a local failure (memory); the others are left to time out
        sizes = [(b - a) * itemsize for a, b in bounds]
        codecs = [_PLAIN] * n
    else:
        # the sizes are known once every rank has reduced: one small gather, which also carries a failure (the daemon
        # gone between the two phases) so that no rank waits for a shard that never comes
        row = torch.tensor([red.data.numel() if red is not None else 0, red.codec if red is not None else 0,
                            call.status], dtype=torch.int64)
        out = torch.empty(3 * n, dtype=torch.int64, device=call.wire)
        dist.all_gather_into_tensor(out, call.to_wire(row), group=call.group)
        call.traffic.bytes_sent += 3 * 8 * (n - 1)
        rows = out.view(n, 3).cpu().tolist()
        call.raise_own()
        failed = [r for r, x in enumerate(rows) if x[2] != _OK]
        if failed:
            raise RuntimeError(f"tzip.distributed.all_reduce: rank(s) {failed} failed between the exchange and the "
                               "gather (the error is raised there); the tensor is left partly reduced")
        sizes = [x[0] for x in rows]
        codecs = [x[1] for x in rows]
    if n == 1:
        if acc is not own:
            _copy_bits(own, acc)
        if copied:
            _copy_bits(tensor, flat)
        call.done()
        return call.traffic

    got_frames = _gather_frames(call, red, sizes)
    call.traffic.bytes_raw += (mine_b - mine_a) * itemsize * (n - 1)

    # 5. every other rank's reduced shard into the tensor
    call.decode([_Wire(got_frames[r], codecs[r]) for r in others],
                [(tensor.dtype, torch.Size([bounds[r][1] - bounds[r][0]])) for r in others],
                [flat[bounds[r][0] : bounds[r][1]] for r in others])
    if acc is not own:
        _copy_bits(own, acc)
    if copied:
        _copy_bits(tensor, flat)
    call.done()
    return call.traffic
