"""all_reduce: the lossless compressed all-reduce, in pieces whose codec work overlaps the transfers of their
neighbours (the algorithm and its guarantees are in tzip.distributed's docstring; the schedule is
:meth:`_AllReduce.pipeline`'s)."""

from __future__ import annotations

import concurrent.futures

import torch
import torch.distributed as dist

from ..client import Client
from ._call import (_OK, _PLAIN, MismatchError, ReduceOp, Traffic, _Call, _Wire, _bytes_of, _check_op, _check_tensor,
                    _copy_bits, _desc_or_none, _header, _key, _op_code, _shards, _show)
from ._collectives import _check_ops, _reduce_in_rank_order, _start_exchange, _start_gather

# Bytes per piece of a CUDA tensor when the caller gives no piece_bytes (a CPU tensor goes in one piece). Why by
# device: pieces overlap the codec with the link only where the codec does not run on the CPU that also moves the
# bytes. On the 2-vCPU development VM (CPU codec through the daemon, gloo on loopback) a 100 MB bf16 all-reduce took
# 0.43 s in one piece and 0.47-0.56 s in pieces of 8-25 MB: every step is CPU work there, and a piece adds two small
# gathers and three codec requests (docs/benchmarks.md, "Compressed all-reduce"). For CUDA tensors the GPU codes
# while the CPU moves the previous piece, but each codec request costs ~0.45 ms of host time whatever its size, and a
# piece makes four. On an H100 (gloo over loopback, fast, 2 ranks; docs/benchmarks.md, "First GPU figures") a 25 MB
# bucket took 21-25 ms in one piece against 32-33 ms in 8 MiB pieces and 46-48 in 4 MiB pieces; at 100 MB, 8 MiB
# pieces won for fp32 (101 against 124-136 ms) and not for bf16 (102 against 89-120). So 32 MiB: a DDP bucket of 25
# MB stays whole, a 100 MB one goes in 3 pieces (that size itself not yet measured).
PIECE_BYTES = 32 << 20


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, codec: str | None = None, client: Client | None = None,
               strict: bool = False, *, piece_bytes: int | None = None) -> torch.Tensor:
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
        piece_bytes: bytes of the tensor per piece (rounded down to whole elements, at least one): the tensor is
            reduced piece by piece, the codec work of one piece overlapping the transfers of the others; 0: one
            piece. None (default): :data:`PIECE_BYTES` for a CUDA tensor, one piece for a CPU tensor (where the
            CPU both codes and moves the bytes, pieces measured slower). Every rank must pass the same value, or
            hold its tensor on the same kind of device when passing None. The result does not
            depend on it, except a complex PRODUCT's last bits and which NaN payload a NaN carries (both follow
            the shard boundaries: the module docstring).

    Raises (on every rank of the call, before any tensor data moves): MismatchError (the ranks' dtypes, shapes, ops
    or pieces differ), ValueError (an unsupported op or codec, a negative piece_bytes), TypeError (the op is not
    defined for the dtype), and RuntimeError on the others when one rank failed; DaemonUnavailableError as above. A
    rank that fails after the data started moving (its daemon gone) raises its error and the others RuntimeError,
    with the tensor left partly reduced.
    """
    _all_reduce(tensor, op, group, codec, client, strict, piece_bytes)
    return tensor


def _all_reduce(tensor: torch.Tensor, op, group, codec: str | None, client: Client | None, strict: bool,
                piece_bytes: int | None = None) -> Traffic:
    """all_reduce's work; returns this call's traffic (also added to counters())."""
    call = _Call("all_reduce", group, tensor, codec, client, strict)
    if not call.member:
        return call.traffic
    _AllReduce(call, tensor, op, piece_bytes).run()
    return call.traffic


def _pieces(numel: int, itemsize: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of the pieces of a flat tensor: piece_bytes // itemsize elements each (at least
    one; 0: the whole tensor), the last one shorter; none for an empty tensor."""
    if numel == 0:
        return []
    per = numel if piece_bytes == 0 else max(1, piece_bytes // itemsize)
    return [(a, min(a + per, numel)) for a in range(0, numel, per)]


def _checked_piece_bytes(piece_bytes, device: torch.device) -> int:
    """all_reduce's piece_bytes for a tensor on ``device``, checked (ValueError)."""
    if piece_bytes is None:
        return PIECE_BYTES if device.type == "cuda" else 0
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 0:
        raise ValueError(f"piece_bytes must be an int >= 0 (0: one piece) or None, got {piece_bytes!r}")
    return piece_bytes


class _AllReduce:
    """One all_reduce call: the checks and the header exchange (:meth:`run`), then the pieces (:meth:`pipeline`).

    Each piece is all-reduced as the module docstring describes a whole tensor (its own world-size shards); pieces
    only change which elements travel together, so the result is the same for every piece size (each element is
    reduced by the same ops in the same rank order). The sizes of piece 0's frames ride in the call's header; a later
    piece's go in a small gather of their own, which also carries each rank's status so that a rank whose daemon
    fails mid-call stops every rank at the same collective instead of leaving them waiting."""

    def __init__(self, call: _Call, tensor, op, piece_bytes) -> None:
        self.call, self.tensor, self.op, self.piece_bytes = call, tensor, op, piece_bytes
        self.code = 0
        self.flat: torch.Tensor | None = None
        self.pieces: list[tuple[int, int]] = []
        self.all_plain = False
        self.pending: list = []  # collectives in flight, waited for before an error leaves the call
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # encodes the next piece's shards
        self.stream = None  # the caller's CUDA stream, for the codec thread's work on CUDA tensors
        # this rank sends plain bytes (codec="raw", or the job's codec off when the call began); fixed for the call,
        # since the job's codec may change while a piece is encoded (frames say their own codec)
        self.raw = False

    # --- the call ---------------------------------------------------------------------------------------------------
    def run(self) -> None:
        call, tensor, n = self.call, self.tensor, self.call.n
        got = call.attempt(self.prepare)
        sent0 = got if got is not None else []
        frames = [(w.data.numel(), w.codec) for w in sent0]
        # aux1: bit 0 set when this rank sends plain bytes (codec="raw"), so that its frames' sizes are known without
        # asking; the number of pieces above it
        try:
            heads = call.exchange(_header("all_reduce", call.status, n, _desc_or_none(tensor), self.code,
                                          int(self.raw) + 2 * len(self.pieces), frames, n))
            self.reduce(heads, sent0)
        finally:
            self.drain()
        call.done()

    def reduce(self, heads, sent0: list[_Wire]) -> None:
        """The call after the header exchange: its checks, then the pieces."""
        call, tensor, n = self.call, self.tensor, self.call.n
        call.raise_failed(heads)
        _check_ops(call, heads)
        ref = heads[0].desc
        odd = [r for r, h in enumerate(heads) if _key(h.desc) != _key(ref)]
        if odd:
            raise MismatchError("tzip.distributed.all_reduce: the ranks' tensors differ: " +
                                ", ".join(f"rank {r}: {_show(h.desc)}" for r, h in enumerate(heads)))
        if len({h.aux1 >> 1 for h in heads}) > 1:
            raise MismatchError("tzip.distributed.all_reduce: the ranks split the tensor into different numbers of "
                                "pieces (every rank must pass the same piece_bytes; with None, CUDA and CPU tensors "
                                "are split differently): " +
                                ", ".join(f"rank {r}: {h.aux1 >> 1}" for r, h in enumerate(heads)))
        self.all_plain = all(h.aux1 & 1 for h in heads)  # every rank sends plain bytes: the sizes are the shards'
        if n == 1:
            for k in range(len(self.pieces)):
                self.reduce_alone(k)
        elif self.pieces:
            self.pipeline([[f[0] for f in h.frames[:n]] for h in heads], [h.frames[call.me][1] for h in heads], sent0)
        if self.pieces and not tensor.is_contiguous():
            _copy_bits(tensor, self.flat)

    def prepare(self) -> list[_Wire]:
        """Checks the call and encodes piece 0 (its frames' sizes go in the header)."""
        call, tensor = self.call, self.tensor
        call.check_codec()
        self.code = _op_code(self.op)
        _check_tensor(tensor, "tensor")
        _check_op(self.code, tensor.dtype, tensor.device)
        piece_bytes = _checked_piece_bytes(self.piece_bytes, tensor.device)
        self.flat = tensor.detach().contiguous().reshape(-1)  # a view when contiguous: results land in the tensor
        self.pieces = _pieces(self.flat.numel(), tensor.element_size(), piece_bytes)
        if call.n > 1 and self.pieces:
            call.resolve_codec()  # every rank encodes: plain for all shards when the job's codec is off
        self.raw = call.codec == "raw"
        if call.n == 1 or not self.pieces:
            return []
        if len(self.pieces) > 1 and not self.raw:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tzip-pieces")
            if self.flat.is_cuda:
                self.stream = torch.cuda.current_stream(self.flat.device)
        return self.encode(0)

    # --- one piece ----------------------------------------------------------------------------------------------------
    def shards(self, k: int) -> list[tuple[int, int]]:
        """[start, end) in the flat tensor of the n shards of piece k."""
        a, b = self.pieces[k]
        return [(a + s, a + e) for s, e in _shards(b - a, self.call.n)]

    def encode(self, k: int) -> list[_Wire]:
        """What this rank sends of piece k, per rank (its own slot empty unless plain: all_to_all_single then sends
        the piece's bytes as they lie, with no copy)."""
        call, flat = self.call, self.flat
        bounds = self.shards(k)
        if self.raw:
            return [_Wire(call.to_wire(_bytes_of(flat[a:b])), _PLAIN) for a, b in bounds]
        sent = call.encode([flat[a:b] for j, (a, b) in enumerate(bounds) if j != call.me])
        sent.insert(call.me, _Wire(torch.empty(0, dtype=torch.uint8, device=call.wire), _PLAIN))
        return sent

    def encode_in_stream(self, k: int) -> list[_Wire]:
        """:meth:`encode` on the codec thread, on the caller's CUDA stream (reads ordered after its writes)."""
        if self.stream is None:
            return self.encode(k)
        with torch.cuda.stream(self.stream):
            return self.encode(k)

    def start_encode(self, k: int):
        """Piece k's frames: a future when the codec thread encodes them, else the frames themselves (plain bytes
        take no time; one piece needs no thread)."""
        if k >= len(self.pieces):
            return None
        if self.pool is None:
            return self.call.attempt(lambda: self.encode(k))
        return self.pool.submit(self.encode_in_stream, k)

    def take_encoded(self, pending) -> list[_Wire] | None:
        """start_encode's result (None after a failure, kept in call.error for the next exchange)."""
        if not isinstance(pending, concurrent.futures.Future):
            return pending
        try:
            return pending.result()
        except Exception as e:  # noqa: BLE001 - raised by the next exchange (check_rows)
            self.call.error = e
            return None
        finally:
            # not through call.attempt(pending.result): its frame would hold the future, which holds the error, whose
            # traceback holds that frame; the cycle would keep the call and its process group alive (_Call.raise_own)
            del pending

    def sizes(self, k: int, sent: list[_Wire] | None) -> tuple[list[list[int]], list[int]]:
        """Piece k's frame sizes (rank r sends sizes[r][j] bytes to rank j) and the codecs of the frames sent here:
        the plain shards' when every rank sends plain bytes, else from a gather of every rank's row, which also says
        whether its encode failed (then every rank raises here)."""
        call, n, me = self.call, self.call.n, self.call.me
        if self.all_plain:
            call.raise_own()  # plain bytes, no daemon: a local failure (memory); the others are left to time out
            return [self.plain_sizes(k)] * n, [_PLAIN] * n
        mine = [x for w in sent for x in (w.data.numel(), w.codec)] if sent is not None else [0] * (2 * n)
        rows = self.gather_row(mine + [call.status])
        self.check_rows(rows, f"while encoding piece {k + 1} of {len(self.pieces)}")
        return [r[0:2 * n:2] for r in rows], [r[2 * me + 1] for r in rows]

    def plain_sizes(self, k: int) -> list[int]:
        """Bytes of each of piece k's n shards: the size of every frame of it when all ranks send plain bytes."""
        item = self.flat.element_size()
        return [(b - a) * item for a, b in self.shards(k)]

    def gather_row(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (int64 values, one small all_gather)."""
        call = self.call
        out = torch.empty(call.n * len(row), dtype=torch.int64, device=call.wire)
        dist.all_gather_into_tensor(out, call.to_wire(torch.tensor(row, dtype=torch.int64)), group=call.group)
        call.traffic.bytes_sent += len(row) * 8 * (call.n - 1)
        return out.view(call.n, len(row)).cpu().tolist()

    def check_rows(self, rows: list[list[int]], when: str) -> None:
        """Raises this rank's own error, else RuntimeError when a rank's row (status last) says it failed."""
        self.call.raise_own()
        failed = [r for r, x in enumerate(rows) if x[-1] != _OK]
        if failed:
            raise RuntimeError(f"tzip.distributed.all_reduce: rank(s) {failed} failed {when} (the error is raised "
                               "there); the tensor is left partly reduced")

    def send(self, k: int, sent: list[_Wire], sizes: list[list[int]]):
        """Starts piece k's exchange: shard j of every rank to rank j. Returns (work or None, received parts)."""
        call = self.call
        if self.raw:
            a, b = self.pieces[k]
            send_buf = call.to_wire(_bytes_of(self.flat[a:b]))
        else:
            send_buf = torch.cat([w.data for w in sent])
        work, parts = _start_exchange(call, sizes, send_buf)
        self.track(work)
        a, b = self.shards(k)[call.me]
        call.traffic.bytes_raw += ((self.pieces[k][1] - self.pieces[k][0]) - (b - a)) * self.flat.element_size()
        return work, parts

    def reduce_and_encode(self, k: int, parts: list[torch.Tensor], codecs: list[int]):
        """Decodes the n-1 shards of piece k sent here, reduces the n in rank order and encodes the result; returns
        (the reduced shard, its wire form)."""
        call, n, me = self.call, self.call.n, self.call.me
        a, b = self.shards(k)[me]
        own = self.flat[a:b]
        others = [r for r in range(n) if r != me]
        decoded = call.decode([_Wire(parts[r], codecs[r]) for r in others],
                              [(self.flat.dtype, torch.Size([b - a]))] * len(others), [None] * len(others))
        shards = list(decoded)
        shards.insert(me, own)
        # every shard may be overwritten: decoded ones are ours (fresh tensors, or regions of the receive buffer that
        # are read once), and our own shard of the tensor gets the result anyway
        acc = _reduce_in_rank_order(self.code, shards, [True] * n, n)
        if self.all_plain:
            return acc, _Wire(call.to_wire(_bytes_of(acc)), _PLAIN)
        return acc, call.encode([acc])[0]

    def reduce_alone(self, k: int) -> None:
        """A group of one: piece k reduced with itself (AVG: divided by 1), as the n-rank steps would."""
        a, b = self.pieces[k]
        own = self.flat[a:b]
        acc = _reduce_in_rank_order(self.code, [own], [True], 1)
        if acc is not own:
            _copy_bits(own, acc)

    # --- the schedule --------------------------------------------------------------------------------------------------
    def pipeline(self, sizes0: list[list[int]], codecs0: list[int], sent0: list[_Wire]) -> None:
        """Every piece through exchange, reduce and gather, in one order on every rank (their collectives must match)
        and overlapped: while piece k's shards cross the link, the codec thread encodes piece k+1's and this thread
        decodes piece k-1's gathered results into the tensor; piece k's gather is in flight while piece k+1 is
        exchanged."""
        call, n, me = self.call, self.call.n, self.call.me
        others = [r for r in range(n) if r != me]
        nxt = self.start_encode(1)
        back = None  # the previous piece's gather in flight: (piece, work, frames, codecs, reduced shard)
        for k in range(len(self.pieces)):
            if k == 0:
                sent, sizes, codecs = sent0, sizes0, codecs0
            else:
                sent = self.take_encoded(nxt)
                # the future may hold this piece's encode error, which sizes() raises: kept here, this frame (in the
                # error's traceback) would hold the future and the error a cycle (_Call.raise_own)
                nxt = None
                sizes, codecs = self.sizes(k, sent)
                nxt = self.start_encode(k + 1)
            work, parts = self.send(k, sent, sizes)
            if back is not None:
                self.finish(*back)
                back = None
            self.wait(work)
            got = call.attempt(lambda: self.reduce_and_encode(k, parts, codecs))
            acc, red = got if got is not None else (None, None)
            if self.all_plain:
                call.raise_own()
                gsizes = self.plain_sizes(k)
                gcodecs = [_PLAIN] * n
            else:
                # the sizes are known once every rank has reduced: one small gather, which also carries a failure
                # (the daemon gone between the two phases) so that no rank waits for a shard that never comes
                rows = self.gather_row([red.data.numel() if red is not None else 0,
                                        red.codec if red is not None else 0, call.status])
                self.check_rows(rows, "between the exchange and the gather")
                gsizes = [x[0] for x in rows]
                gcodecs = [x[1] for x in rows]
            gwork, frames = _start_gather(call, red, gsizes)
            self.track(gwork)
            a, b = self.shards(k)[me]
            call.traffic.bytes_raw += (b - a) * self.flat.element_size() * (n - 1)
            back = (k, gwork, [frames[r] for r in others], [gcodecs[r] for r in others], acc)
        if back is not None:
            self.finish(*back)

    def finish(self, k: int, work, frames: list[torch.Tensor], codecs: list[int], acc: torch.Tensor) -> None:
        """Piece k's end: every other rank's reduced shard decoded into the tensor, ours copied in when the reduction
        left it elsewhere."""
        call, me = self.call, self.call.me
        self.wait(work)
        bounds = self.shards(k)
        others = [r for r in range(call.n) if r != me]
        call.decode([_Wire(f, c) for f, c in zip(frames, codecs)],
                    [(self.flat.dtype, torch.Size([bounds[r][1] - bounds[r][0]])) for r in others],
                    [self.flat[bounds[r][0] : bounds[r][1]] for r in others])
        a, b = bounds[me]
        own = self.flat[a:b]
        if acc is not own:
            _copy_bits(own, acc)

    def track(self, work) -> None:
        """Keeps a collective just started (None: none was needed) in :attr:`pending` until :meth:`wait`."""
        if work is not None:
            self.pending.append(work)

    def wait(self, work) -> None:
        """Waits for a collective of :attr:`pending` (None: none was needed) and forgets it, and with it the buffers it
        holds: a call of many pieces keeps only the pieces in flight."""
        if work is not None:
            work.wait()
            self.pending.remove(work)

    def drain(self) -> None:
        """Waits for what the call left in flight (all of it when an error leaves the call: every rank posted the same
        collectives, so they complete) and stops the codec thread."""
        for work in self.pending:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the call already raises its own error
                pass
        self.pending = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
