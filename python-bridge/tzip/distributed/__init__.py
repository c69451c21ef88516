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

A tensor larger than ``piece_bytes`` (default: :data:`PIECE_BYTES` for CUDA tensors, one piece on the CPU) goes
through these steps in pieces of that many bytes, each split into its own ``world_size`` shards, and the pieces
overlap: while piece k's shards cross the link, a codec thread compresses piece k+1's and the caller's thread
decompresses piece k-1's gathered results. Piece 0's frame sizes ride in the call's header; each later piece's go in
a small gather that also carries every rank's status, so a rank whose daemon fails mid-call stops every rank at the
same step.

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
  in the scalar tail, so it follows the shard boundaries (and the pieces'): the same on every rank and for every
  codec, not always the same as one product of whole tensors.
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

from ._all_reduce import PIECE_BYTES, all_reduce
from ._call import MismatchError, ReduceOp, Traffic, counters
from ._collectives import all_gather, broadcast, reduce_scatter
from ._p2p import Work, irecv, isend, recv, send

__all__ = [
    "ReduceOp",
    "MismatchError",
    "Work",
    "Traffic",
    "PIECE_BYTES",
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
