"""tzip.distributed over real gloo process groups of 2 and 4 worker processes and a real daemon (one per module).

Every call, for every dtype, with empty, 1-element, 0-dim and non-contiguous tensors, compared bit for bit (integer
views) with tensors the test rebuilds itself; all_reduce compared with the same algorithm at codec="raw", with a
reduction in rank order computed here, and (two ranks) with dist.all_reduce; mismatches raising on every rank; the
counters; the daemon away (raw frames and one warning; strict raises). GPU variants at the end (skipped without one).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tzip.client as tz
import tzip.distributed as tzd
from tzip.distributed._call import _Call, _header_len
from tzip.distributed import ReduceOp

from dist_support import Pools, bits, run_without_daemon
from test_client_support import shared_daemon  # noqa: F401

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]
DTYPES = [*FLOATS, *INTS, torch.bool, torch.complex64]
SHAPES = [(), (0,), (1,), (3,), (2, 0, 5), (37, 11), (70001,)]
OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PRODUCT, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype.is_complex:
        return ["SUM", "AVG", "PRODUCT"]
    if dtype.is_floating_point:
        return list(OPS)
    return ["SUM", "PRODUCT", "MIN", "MAX"]


_NAN_BITS = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC0_0001, torch.float64: 0x7FF8_0000_0000_0001}


def data(rank: int, shape, dtype: torch.dtype, seed: int, special: bool = True) -> torch.Tensor:
    """Rank ``rank``'s input: gradient-like floats (with -0.0, a subnormal, inf and a NaN with a payload when
    ``special``), small integers, random bools. The same on every process."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.is_complex:
        return (torch.randn(shape, dtype=torch.complex128, generator=g) * 0.02).to(dtype)
    if dtype.is_floating_point:
        t = (torch.randn(shape, dtype=torch.float64, generator=g) * 0.02).to(dtype)
        if special and t.numel() >= 8:
            flat = t.view(-1)
            n = flat.numel()
            flat[(3 + rank) % n] = -0.0
            flat[(5 + 2 * rank) % n] = torch.finfo(dtype).smallest_normal / 4  # a subnormal
            flat[(7 * rank + 1) % n] = float("inf") if rank % 2 else float("-inf")
            nan = torch.tensor(_NAN_BITS[dtype] + rank, dtype=bits(flat[:1]).dtype)
            bits_view = flat.view(nan.dtype)
            bits_view[(11 + 3 * rank) % n] = nan
        return t
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _reduce(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == "AVG":
        acc = acc / len(xs)
    return acc


def reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    """x0 op x1 op ... in rank order, out of place (AVG: the sum, then / n), in the dtype of the inputs, shard by
    shard as all_reduce splits the flat tensor (world-size shards, the first numel % n one element longer): a complex
    product's last bit depends on whether torch multiplies an element in a vector lane or in the scalar tail."""
    n = len(xs)
    flats = [x.reshape(-1) for x in xs]
    q, r = divmod(flats[0].numel(), n)
    pieces, start = [], 0
    for k in range(n):
        end = start + q + (1 if k < r else 0)
        pieces.append(_reduce(op, [f[start:end] for f in flats]))
        start = end
    return torch.cat(pieces).reshape(xs[0].shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def pools(shared_daemon):  # noqa: F811
    p = Pools({"TZIP_SOCKET": shared_daemon.socket})
    yield p
    p.close()


# --- worker functions (run on every rank: fn(rank, world_size, **kwargs)) --------------------------------------------


def _dtypes(names):
    return [getattr(torch, n) for n in names] if names else DTYPES


def w_all_reduce_matrix(rank, world, codecs, dtypes=None, shapes=None, extras=True):
    checked = 0
    for di, dtype in enumerate(_dtypes(dtypes)):
        for si, shape in enumerate(shapes or SHAPES):
            for oi, op in enumerate(ops_for(dtype)):
                seed = (di * 100 + si) * 10 + oi
                xs = [data(r, shape, dtype, seed) for r in range(world)]
                want = reference(op, xs)
                for codec in codecs:
                    t = xs[rank].clone()
                    out = tzd.all_reduce(t, op=OPS[op], codec=codec)
                    assert out is t
                    assert same(t, want), (str(dtype), shape, op, codec)
                    checked += 1
    if not extras:
        return checked
    # non-contiguous tensors (results written back through the view), and one large tensor (shards of >= 1 MiB)
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        xs = [data(r, (33, 70), dtype, 999).t() for r in range(world)]
        want = reference("SUM", xs)
        for codec in codecs:
            t = xs[rank].clone().t().contiguous().t()  # the same strides as xs[rank]
            assert not t.is_contiguous()
            tzd.all_reduce(t, codec=codec)
            assert same(t, want), (str(dtype), "transposed", codec)
            checked += 1
    xs = [data(r, (1 << 20) + 3, torch.float32, 1000) for r in range(world)]
    want = reference("SUM", xs)
    for codec in codecs:
        t = xs[rank].clone()
        tzd.all_reduce(t, codec=codec)
        assert same(t, want), ("large", codec)
        checked += 1
    return checked


def w_all_reduce_vs_dist(rank, world):
    """Two ranks: every op where the order cannot matter, against dist.all_reduce (gloo)."""
    assert world == 2
    checked = 0
    for di, dtype in enumerate([*FLOATS, *INTS, torch.complex64]):
        for si, shape in enumerate([(), (0,), (1,), (37, 11), (70001,)]):
            ops = ["SUM"] if dtype.is_complex else ["SUM", "PRODUCT", "MIN", "MAX"]
            for op in ops:
                # no NaN (which of two NaNs survives depends on the order) and no +-0 ties for MIN/MAX
                x = data(rank, shape, dtype, di * 10 + si, special=False)
                plain = x.clone()
                dist.all_reduce(plain, op=OPS[op])
                for codec in ("auto", "raw"):
                    t = x.clone()
                    tzd.all_reduce(t, op=OPS[op], codec=codec)
                    assert same(t, plain), (str(dtype), shape, op, codec)
                    checked += 1
            if dtype.is_floating_point:  # AVG: the SUM, then one division in the dtype
                x = data(rank, shape, dtype, di * 10 + si, special=False)
                plain = x.clone()
                dist.all_reduce(plain)
                plain = plain / 2
                t = x.clone()
                tzd.all_reduce(t, op=ReduceOp.AVG)
                assert same(t, plain), (str(dtype), shape, "AVG")
                checked += 1
    # NaNs (with payloads), infinities, -0.0 and subnormals: SUM gives NaN where gloo does, every other element bit
    # for bit (the module docstring: a NaN's bits are the arithmetic's choice)
    for dtype in FLOATS:
        x = data(rank, (70001,), dtype, 99)
        plain = x.clone()
        dist.all_reduce(plain)
        t = x.clone()
        tzd.all_reduce(t)
        nan = plain.isnan()
        assert nan.any() and torch.equal(t.isnan(), nan), str(dtype)
        assert same(t[~nan], plain[~nan]), str(dtype)
        checked += 1
    # bool: gloo adds the bytes (True + True stores 2); tzip's SUM is logical or: the same truth values
    x = data(rank, (1000,), torch.bool, 5)
    plain = x.clone()
    dist.all_reduce(plain)
    t = x.clone()
    tzd.all_reduce(t)
    assert torch.equal(t, plain.view(torch.uint8) != 0) and bits(t).max() <= 1
    return checked + 1


def w_collectives(rank, world, codecs, dtypes=None, shapes=None):
    """send/recv (pairs, a ring of isend/irecv, several messages in flight), broadcast from every rank, all_gather
    (ranks of different shapes too), reduce_scatter, for every dtype and shape."""
    checked = 0
    for di, dtype in enumerate(_dtypes(dtypes)):
        for si, shape in enumerate(shapes or SHAPES):
            seed = di * 100 + si
            for codec in codecs:
                # ring: every rank sends to the next and receives from the previous, both in flight at once
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                mine = data(rank, shape, dtype, seed)
                out = torch.empty(shape, dtype=dtype)
                ws = tzd.isend(mine, nxt, codec=codec)
                wr = tzd.irecv(out, prv)
                assert ws.wait(timeout=60) is None
                assert wr.wait(timeout=60) is out and ws.is_completed() and wr.is_completed()
                assert same(out, data(prv, shape, dtype, seed)), ("ring", str(dtype), shape, codec)
                # blocking pairs: even ranks send to the odd next one
                peer = rank ^ 1
                if rank % 2 == 0:
                    tzd.send(mine, peer, codec=codec)
                else:
                    got = tzd.recv(torch.empty(shape, dtype=dtype), peer)
                    assert same(got, data(peer, shape, dtype, seed)), ("pair", str(dtype), shape, codec)
                for src in range(world):
                    t = data(src, shape, dtype, seed) if rank == src else torch.zeros(shape, dtype=dtype)
                    assert tzd.broadcast(t, src=src, codec=codec) is t
                    assert same(t, data(src, shape, dtype, seed)), ("broadcast", str(dtype), shape, src, codec)
                outs = [torch.empty(shape, dtype=dtype) for _ in range(world)]
                assert tzd.all_gather(outs, mine, codec=codec) is outs
                for r in range(world):
                    assert same(outs[r], data(r, shape, dtype, seed)), ("all_gather", str(dtype), shape, codec)
                for op in ops_for(dtype):
                    ins = [data(rank, shape, dtype, seed * world + j) for j in range(world)]
                    o = torch.empty(shape, dtype=dtype)
                    assert tzd.reduce_scatter(o, ins, op=OPS[op], codec=codec) is o
                    want = _reduce(op, [data(r, shape, dtype, seed * world + rank) for r in range(world)])
                    assert same(o, want), ("reduce_scatter", str(dtype), shape, op, codec)
                checked += 1
    # several messages in flight to one peer arrive in order; a non-contiguous tensor is sent and received
    for codec in codecs:
        peer = rank ^ 1
        if rank % 2 == 0:
            works = [tzd.isend(data(rank, (50, 3), torch.bfloat16, k).t(), peer, codec=codec) for k in range(5)]
            for w in works:
                w.wait(timeout=60)
        else:
            outs = [torch.empty(50, 3, dtype=torch.bfloat16).t() for _ in range(5)]
            works = [tzd.irecv(o, peer) for o in outs]
            for k, (w, o) in enumerate(zip(works, outs)):
                assert w.wait(timeout=60) is o
                assert same(o, data(peer, (50, 3), torch.bfloat16, k).t()), ("in order", k, codec)
    # all_gather of tensors whose shapes differ between the ranks
    mine = data(rank, (rank + 1, 4), torch.float16, 77)
    outs = [torch.empty(r + 1, 4, dtype=torch.float16) for r in range(world)]
    tzd.all_gather(outs, mine)
    assert all(same(outs[r], data(r, (r + 1, 4), torch.float16, 77)) for r in range(world))
    return checked


class DecompressFails:
    """Fault injection: the process-wide client, except that decompress raises as when the daemon has gone away
    between the two phases of an all-reduce."""

    def __init__(self):
        from tzip._default import default_client

        self.inner = default_client()

    def compress(self, *args, **kwargs):
        return self.inner.compress(*args, **kwargs)

    def decompress(self, *args, **kwargs):
        raise tz.DaemonUnavailableError("injected: the daemon went away")


def _calls_alive() -> int:
    """tzip.distributed's per-call objects still alive (each holds its process group)."""
    for t in threading.enumerate():  # isend/irecv's worker threads hold their call until they return
        if t.name.startswith("tzip-p2p"):
            t.join(10)
    return sum(1 for o in gc.get_objects() if isinstance(o, _Call))


def _recorder(seen: dict, left: dict):
    """``case(name, fn)``: runs fn and records in ``seen[name]`` what it raised (type name, message, seconds; None when
    nothing) and in ``left[name]`` the calls it left alive (:func:`_calls_alive`)."""

    def case(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            seen[name] = (None, "", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the test
            seen[name] = (type(e).__name__, str(e), time.monotonic() - t0)
        left[name] = _calls_alive()

    return case


def w_mismatches(rank, world):
    """Each case: what this rank raised (type name, message, seconds), or None; and the calls each case left alive
    with the garbage collector off (a reference cycle keeps its call, and so its process group, until a collection:
    destroy_process_group() then could not free the group and processes died with SIGABRT at exit)."""
    seen = {}
    left = {}
    case = _recorder(seen, left)

    def p2p(sent, into):  # even ranks send to the next odd one
        if rank % 2 == 0:
            tzd.send(sent, rank + 1)
        else:
            tzd.recv(into, rank - 1)

    last = world - 1  # the odd one out in the collectives
    gc.collect()
    gc.disable()
    case("p2p size", lambda: p2p(torch.zeros(10), torch.zeros(11)))
    case("p2p dtype", lambda: p2p(torch.zeros(10), torch.zeros(10, dtype=torch.float64)))
    case("p2p shape", lambda: p2p(torch.zeros(2, 5), torch.zeros(5, 2)))
    case("p2p dims past the 8th", lambda: p2p(torch.zeros([1] * 8 + [2, 3]), torch.zeros([1] * 8 + [3, 2])))
    case("p2p empty vs 0-dim", lambda: p2p(torch.zeros(0), torch.zeros(())))
    case("broadcast shape", lambda: tzd.broadcast(torch.zeros(5 if rank == last else 4), src=0))
    case("broadcast src", lambda: tzd.broadcast(torch.zeros(4), src=1 if rank == last else 0))
    case("all_reduce dtype", lambda: tzd.all_reduce(torch.zeros(4, dtype=torch.bfloat16 if rank == last else torch.float32)))
    case("all_reduce shape", lambda: tzd.all_reduce(torch.zeros(2, 3) if rank == last else torch.zeros(3, 2)))
    case("all_reduce op", lambda: tzd.all_reduce(torch.zeros(4), op=ReduceOp.MAX if rank == last else ReduceOp.SUM))
    case("all_gather list", lambda: tzd.all_gather([torch.zeros(3 if rank == last and r == 0 else 4)
                                                    for r in range(world)], torch.zeros(4)))
    case("all_gather list length", lambda: tzd.all_gather([torch.zeros(4)] * (world + (rank == last)), torch.zeros(4)))
    case("reduce_scatter output", lambda: tzd.reduce_scatter(torch.zeros(3 if rank == last else 4),
                                                             [torch.zeros(4)] * world))
    case("different calls", lambda: tzd.broadcast(torch.zeros(4), src=0) if rank == last else tzd.all_reduce(torch.zeros(4)))
    # one rank fails before the exchange: its own error there, RuntimeError on the others
    case("one rank's bad op", lambda: tzd.all_reduce(torch.zeros(4), op=ReduceOp.BAND if rank == last else ReduceOp.SUM))
    case("one rank's bad codec", lambda: tzd.broadcast(torch.zeros(4), src=0, codec="zstd" if rank == last else "auto"))
    case("receiver's sparse tensor", lambda: p2p(torch.zeros(4), torch.zeros(4).to_sparse()))
    # one rank cannot decompress the shards it received: the others hear of it before the gather
    case("decompress fails between the phases",
         lambda: tzd.all_reduce(torch.randn(1000), client=DecompressFails() if rank == last else None))
    # everyone wrong: the same error everywhere
    case("BAND", lambda: tzd.all_reduce(torch.zeros(4, dtype=torch.int32), op=ReduceOp.BAND))
    case("MIN of complex", lambda: tzd.all_reduce(torch.zeros(4, dtype=torch.complex64), op=ReduceOp.MIN))
    case("AVG of int", lambda: tzd.all_reduce(torch.zeros(4, dtype=torch.int32), op=ReduceOp.AVG))
    case("SUM of float8", lambda: tzd.all_reduce(torch.zeros(4).to(torch.float8_e4m3fn)))
    gc.enable()
    # the group is still in step
    t = torch.full((3,), float(rank))
    tzd.all_reduce(t)
    return seen, t.tolist(), left


def w_counters(rank, world):
    tzd.counters(reset=True)
    n = 1001
    t = torch.ones(n)
    tzd.all_reduce(t, codec="raw")
    c = tzd.counters(reset=True)["all_reduce"]
    q, r = divmod(n, world)
    shard = q + (1 if rank < r else 0)
    header = (_header_len(world)) * 8
    want_raw = (n - shard) * 4 + shard * 4 * (world - 1)
    want_sent = (n - shard) * 4 + shard * 4 * (world - 1) + header * (world - 1)
    assert (c.calls, c.bytes_raw, c.bytes_sent) == (1, want_raw, want_sent), (c, want_raw, want_sent)
    assert tzd.counters() == {}
    g = data(rank, (1 << 18,), torch.bfloat16, 3, special=False)
    tzd.all_reduce(g)
    tzd.broadcast(g, src=0)
    peer = rank ^ 1
    if rank % 2 == 0:
        tzd.send(g, peer)
    else:
        tzd.recv(g, peer)
    snap = tzd.counters()
    kinds = {"all_reduce", "broadcast", "send" if rank % 2 == 0 else "recv"}
    assert set(snap) == kinds, snap
    assert snap["all_reduce"].bytes_sent < 0.9 * snap["all_reduce"].bytes_raw, snap  # gradient-like bf16 compresses
    p2p = snap["send" if rank % 2 == 0 else "recv"]
    assert p2p.bytes_raw == g.numel() * 2 and p2p.bytes_sent < p2p.bytes_raw
    return {k: (v.calls, v.bytes_raw, v.bytes_sent) for k, v in snap.items()}


def w_daemon_away(rank, world):
    """$TZIP_SOCKET names no daemon and none can be started: raw frames, one warning; strict raises."""
    peer = rank ^ 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, dtype in enumerate((torch.bfloat16, torch.float32, torch.int32)):
            xs = [data(r, (3000,), dtype, k, special=False) for r in range(world)]
            t = xs[rank].clone()
            tzd.all_reduce(t)
            assert same(t, reference("SUM", xs)), str(dtype)
            b = xs[rank].clone()
            tzd.broadcast(b, src=0)
            assert same(b, xs[0])
            if rank % 2 == 0:
                tzd.send(xs[rank], peer)
            else:
                assert same(tzd.recv(torch.empty(3000, dtype=dtype), peer), xs[peer])
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "tzip" in str(w.message)]
    # an explicit lenient client without a daemon behaves the same (it warns once, when made)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = tz.connect(os.environ["TZIP_SOCKET"], spawn=False)
    t = xs[rank].clone()
    tzd.all_reduce(t, client=c)
    assert same(t, reference("SUM", xs))
    c.close()
    snap = tzd.counters()["all_reduce"]
    assert snap.bytes_sent > snap.bytes_raw  # raw frames: headers on top of every byte
    strict = {}
    for name, fn in (("all_reduce", lambda: tzd.all_reduce(torch.ones(10), strict=True)),
                     ("broadcast", lambda: tzd.broadcast(torch.ones(10), src=0, strict=True)),
                     ("send/recv", lambda: tzd.send(torch.ones(10), peer, strict=True) if rank % 2 == 0
                      else tzd.recv(torch.ones(10), peer, strict=True))):
        try:
            fn()
            strict[name] = None
        except tz.DaemonUnavailableError:
            strict[name] = "DaemonUnavailableError"  # (or its subclass DaemonSpawnError: no daemon could be started)
        except Exception as e:  # noqa: BLE001 - reported to the test
            strict[name] = type(e).__name__
    t = torch.ones(4)
    tzd.all_reduce(t, codec="raw")  # still in step
    return ours, strict, t.tolist()


# --- all_reduce in pieces -------------------------------------------------------------------------------------------


def reference_pieces(op: str, xs: list[torch.Tensor], per: int) -> torch.Tensor:
    """:func:`reference` piece by piece (``per`` elements each, the last shorter), as all_reduce(piece_bytes=...)
    reduces: each piece split into world-size shards."""
    flats = [x.reshape(-1) for x in xs]
    n = flats[0].numel()
    if n == 0:
        return reference(op, xs)
    parts = [reference(op, [f[a : a + per] for f in flats]) for a in range(0, n, per)]
    return torch.cat(parts).reshape(xs[0].shape)


def same_but_nan_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN need only be a NaN: which operand's payload survives a NaN-propagating op is
    the arithmetic's choice, and torch's vector lanes and scalar tail choose differently (the module docstring)."""
    if not a.dtype.is_floating_point:
        return same(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and same(a[~nan], b[~nan])


class CompressFailsLater:
    """Fault injection: the process-wide client, except that all_reduce's codec thread (which encodes the pieces after
    the first) fails after ``ok`` requests, as when the daemon has gone away mid-call."""

    def __init__(self, ok: int):
        from tzip._default import default_client

        self.inner, self.ok = default_client(), ok

    def compress(self, *args, **kwargs):
        if threading.current_thread().name.startswith("tzip-pieces"):
            if self.ok <= 0:
                raise tz.DaemonUnavailableError("injected: the daemon went away")
            self.ok -= 1
        return self.inner.compress(*args, **kwargs)

    def decompress(self, *args, **kwargs):
        return self.inner.decompress(*args, **kwargs)


def w_pieces(rank, world):
    """all_reduce in pieces against the same pieces at codec="raw", the piecewise rank-order reference and (where no
    complex product is involved) the one-piece result: pieces of one element, piece sizes that divide neither the
    tensor nor the element size, pieces whose frames are raw (incompressible bits) beside compressed ones, and ranks
    that send plain bytes beside ranks that compress."""
    checked = 0
    every = ("raw", "auto", "fast", "max")
    cases = [(torch.bfloat16, (70001,), [2 * 4099, 1 << 16], every), (torch.float16, (3, 7), [2, 1001], every[:2]),
             (torch.float32, (70001,), [4 * 9999 + 3, 1 << 17], every), (torch.float64, (5,), [8, 8 * 3], every[:2]),
             (torch.int32, (3, 7), [4, 4 * 5], every[:2]), (torch.complex64, (37, 11), [8 * 7, 8 * 100], every[:2])]
    for di, (dtype, shape, sizes, codecs) in enumerate(cases):
        for op in ops_for(dtype):
            xs = [data(r, shape, dtype, 500 + di) for r in range(world)]
            whole = xs[rank].clone()
            tzd.all_reduce(whole, op=OPS[op], codec="raw", piece_bytes=0)
            for pb in sizes:
                per = max(1, pb // dtype.itemsize)
                want = reference_pieces(op, xs, per)
                got = {}
                for codec in codecs:
                    t = xs[rank].clone()
                    assert tzd.all_reduce(t, op=OPS[op], codec=codec, piece_bytes=pb) is t
                    got[codec] = t
                    assert same(t, want), (str(dtype), shape, op, pb, codec)
                    checked += 1
                if not (dtype.is_complex and op == "PRODUCT"):
                    assert same_but_nan_bits(got["raw"], whole), (str(dtype), op, pb, "pieces vs one piece")
    # incompressible halves (raw frames) beside compressible ones, non-contiguous, some ranks plain
    for world_codec in (["auto"] * world, ["raw"] + ["auto"] * (world - 1)):
        xs = []
        for r in range(world):
            g = torch.Generator().manual_seed(77 + r)
            noise = torch.randint(-(1 << 31), (1 << 31) - 1, (50000,), generator=g, dtype=torch.int64).to(torch.int32)
            x = torch.cat([noise.view(torch.float32), data(r, (50000,), torch.float32, 78)]).reshape(400, 250)
            xs.append(x)
        want = reference_pieces("SUM", xs, (1 << 16) // 4)
        from tzip._default import default_client

        # a piece of noise is stored raw (every chunk: no smaller when coded), a piece of the rest is coded
        cts = default_client().compress([xs[rank].reshape(-1)[:16384], xs[rank].reshape(-1)[-16384:]])
        assert cts[0].compressed_nbytes > 16384 * 4 > cts[1].compressed_nbytes, [c.compressed_nbytes for c in cts]
        t = xs[rank].clone().t().contiguous().t()
        tzd.all_reduce(t, codec=world_codec[rank], piece_bytes=1 << 16)
        assert same(t, want), world_codec
        checked += 1
    # the CUDA tensors' default piece size (3 pieces here), with the default codec
    x = data(rank, (3 * tzd.PIECE_BYTES // 4 + 5,), torch.float32, 79, special=False)
    plain = x.clone()
    dist.all_reduce(plain)
    t = x.clone()
    tzd.all_reduce(t, piece_bytes=tzd.PIECE_BYTES)
    if world == 2:
        assert same(t, plain)
    assert same(t, reference("SUM", [data(r, x.shape, torch.float32, 79, special=False) for r in range(world)]))
    return checked + 1


def w_piece_errors(rank, world):
    """Errors of a call in pieces: (type name, message, seconds) per case, the calls left alive without the garbage
    collector, and whether the group is still in step after them."""
    seen, left = {}, {}
    last = world - 1
    case = _recorder(seen, left)

    x = torch.randn(20000)
    gc.collect()
    gc.disable()
    case("different pieces", lambda: tzd.all_reduce(x.clone(), piece_bytes=4000 if rank == last else 8000))
    case("bad piece_bytes", lambda: tzd.all_reduce(x.clone(), piece_bytes=-1 if rank == last else 8000))
    case("bool piece_bytes", lambda: tzd.all_reduce(x.clone(), piece_bytes=True))
    # the codec fails while a later piece is encoded (on the codec thread), or while piece 1's shards are decoded
    case("encode fails at piece 3", lambda: tzd.all_reduce(x.clone(), piece_bytes=8000,
                                                          client=CompressFailsLater(1) if rank == last else None))
    case("decompress fails", lambda: tzd.all_reduce(x.clone(), piece_bytes=8000,
                                                   client=DecompressFails() if rank == last else None))
    gc.enable()
    t = torch.full((3,), float(rank))
    tzd.all_reduce(t, piece_bytes=4)
    return seen, left, t.tolist()



# --- tests ----------------------------------------------------------------------------------------------------------


SHAPES_4 = [(), (0,), (1,), (37, 11)]  # four processes share two cores here: fewer shapes (70001 on two ranks)


def test_all_reduce_four_ranks_equals_raw_and_rank_order(pools):
    n = pools(4).run(w_all_reduce_matrix, timeout=600, codecs=["raw", "auto"], shapes=SHAPES_4)
    assert n[0] > 300 and len(set(n)) == 1


def test_all_reduce_fast_and_max_codecs_equal_raw(pools):
    pools(4).run(w_all_reduce_matrix, timeout=600, codecs=["fast", "max"], extras=False,
                 dtypes=["bfloat16", "float16", "float32", "float64"], shapes=[(1,), (37, 11), (70001,)])


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_in_pieces_equals_raw_and_rank_order(pools, world):
    assert pools(world).run(w_pieces, timeout=900)[0] > 50


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_in_pieces_errors(pools, world):
    last = world - 1
    for rank, (seen, left, after) in enumerate(pools(world).run(w_piece_errors, timeout=300)):
        assert after == [float(sum(range(world)))] * 3
        assert left == dict.fromkeys(left, 0), (rank, left)
        for name, (got, msg, seconds) in seen.items():
            assert seconds < 10, (rank, name, seconds)
        assert seen["different pieces"][0] == "MismatchError" and "piece_bytes" in seen["different pieces"][1]
        assert seen["bad piece_bytes"][0] == ("ValueError" if rank == last else "RuntimeError"), seen["bad piece_bytes"]
        assert seen["bool piece_bytes"][0] == "ValueError"
        enc = seen["encode fails at piece 3"]
        assert enc[0] == ("DaemonUnavailableError" if rank == last else "RuntimeError"), enc
        assert rank == last or ("while encoding piece 3 of 10" in enc[1] and "partly reduced" in enc[1]), enc
        dec = seen["decompress fails"]
        assert dec[0] == ("DaemonUnavailableError" if rank == last else "RuntimeError"), dec
        assert rank == last or "between the exchange and the gather" in dec[1], dec


def test_pieces_cover_the_tensor_once_in_order():
    from tzip.distributed._all_reduce import _checked_piece_bytes, _pieces

    assert _pieces(0, 4, 0) == [] and _pieces(0, 4, 8) == []
    assert _pieces(10, 4, 0) == [(0, 10)]  # one piece
    assert _pieces(10, 4, 3) == [(k, k + 1) for k in range(10)]  # less than an element: one element each
    assert _pieces(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert _pieces(10, 4, 1 << 20) == [(0, 10)]
    for numel in (1, 7, 1000, 4099):
        for pb in (1, 8, 100, 4096):
            got = _pieces(numel, 2, pb)
            assert got[0][0] == 0 and got[-1][1] == numel and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert _checked_piece_bytes(None, torch.device("cpu")) == 0
    assert _checked_piece_bytes(None, torch.device("cuda", 0)) == tzd.PIECE_BYTES
    assert _checked_piece_bytes(5, torch.device("cpu")) == 5
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="piece_bytes"):
            _checked_piece_bytes(bad, torch.device("cpu"))


def test_all_reduce_two_ranks_equals_dist_all_reduce(pools):
    n = pools(2).run(w_all_reduce_vs_dist, timeout=600)
    assert n[0] > 200


def test_every_call_every_dtype_two_ranks(pools):
    pools(2).run(w_collectives, timeout=600, codecs=["auto", "raw"])


def test_every_call_four_ranks(pools):
    pools(4).run(w_collectives, timeout=600, codecs=["auto", "raw"], dtypes=["bfloat16", "float32", "int64", "bool"],
                 shapes=[(), (0,), (1,), (37, 11)])


@pytest.mark.parametrize("world", [2, 4])
def test_mismatch_raises_on_every_rank(pools, world):
    results = pools(world).run(w_mismatches, timeout=300)
    last = world - 1
    expect = {
        "p2p size": "MismatchError", "p2p dtype": "MismatchError", "p2p shape": "MismatchError",
        "p2p dims past the 8th": "MismatchError", "p2p empty vs 0-dim": "MismatchError",
        "broadcast shape": "MismatchError", "broadcast src": "MismatchError", "all_reduce dtype": "MismatchError",
        "all_reduce shape": "MismatchError", "all_reduce op": "MismatchError", "all_gather list": "MismatchError",
        "all_gather list length": "MismatchError", "reduce_scatter output": "MismatchError",
        "different calls": "MismatchError", "BAND": "ValueError", "MIN of complex": "TypeError",
        "AVG of int": "TypeError", "SUM of float8": "TypeError",
    }
    for rank, (seen, after, left) in enumerate(results):
        assert after == [float(sum(range(world)))] * 3
        assert left == dict.fromkeys(left, 0), (rank, left)  # freed without the garbage collector
        for name, want in expect.items():
            got, msg, seconds = seen[name]
            assert got == want, (rank, name, got, msg)
            assert seconds < 10, (rank, name, seconds)  # an error, not the process group's 30 s timeout
        # one rank's own error there; the others are told which rank failed
        assert seen["one rank's bad op"][0] == ("ValueError" if rank == last else "RuntimeError"), seen["one rank's bad op"]
        assert seen["one rank's bad codec"][0] == ("ValueError" if rank == last else "RuntimeError")
        assert f"rank(s) [{last}]" in seen["one rank's bad op"][1] or rank == last
        assert seen["receiver's sparse tensor"][0] == ("TypeError" if rank % 2 else "RuntimeError"), seen["receiver's sparse tensor"]
        between = seen["decompress fails between the phases"]
        assert between[0] == ("DaemonUnavailableError" if rank == last else "RuntimeError"), between
        assert between[2] < 10 and (rank == last or "between the exchange and the gather" in between[1])
    # both sides of a pair, and every rank of a collective, see the same message, naming both descriptions
    for name in expect:
        msgs = {seen[name][1] for seen, _, _ in results}
        if name.startswith("p2p"):
            msgs = {results[0][0][name][1], results[1][0][name][1]}
        assert len(msgs) == 1, (name, msgs)
    assert "rank 0 sends torch.float32 [10], rank 1 receives into torch.float32 [11]" in results[0][0]["p2p size"][1]
    assert "[1, 1, 1, 1, 1, 1, 1, 1, ...]" in results[0][0]["p2p dims past the 8th"][1]


@pytest.mark.parametrize("world", [2, 4])
def test_counters(pools, world):
    pools(world).run(w_counters, timeout=120)


def test_counters_reset_locally():
    tzd.counters(reset=True)
    assert tzd.counters() == {}
    t = tzd.Traffic(2, 100, 40)
    assert t.ratio == 0.4 and tzd.Traffic().ratio != tzd.Traffic().ratio  # NaN when empty


def test_daemon_away_sends_raw_once_warned_and_strict_raises():
    results = run_without_daemon(2, w_daemon_away, timeout=300)
    for rank, (warned, strict, after) in enumerate(results):
        assert len(warned) == 1, warned  # once per process, however many calls
        assert after == [2.0] * 4
        assert strict["all_reduce"] == "DaemonUnavailableError"
    # broadcast and send/recv: the source cannot compress; the others (which only decode) are told it failed
    assert results[0][1]["broadcast"] == "DaemonUnavailableError" and results[1][1]["broadcast"] == "RuntimeError"
    assert results[0][1]["send/recv"] == "DaemonUnavailableError" and results[1][1]["send/recv"] == "RuntimeError"


def test_not_initialised_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tzd.all_reduce(torch.ones(3))


# --- GPU: CUDA tensors over gloo, two ranks on one GPU --------------------------------------------------------------


def w_cuda(rank, world):
    torch.cuda.set_device(0)
    checked = 0
    for di, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.int32)):
        for si, shape in enumerate([(), (0,), (1,), (37, 11), (1 << 20,)]):
            seed = di * 10 + si
            xs = [data(r, shape, dtype, seed, special=False) for r in range(world)]
            plain = xs[rank].clone().cuda()
            dist.all_reduce(plain)
            for codec in ("auto", "raw", "fast"):
                t = xs[rank].clone().cuda()
                tzd.all_reduce(t, codec=codec)
                assert t.device.type == "cuda"
                assert same(t, plain), (str(dtype), shape, codec)
                b = xs[rank].clone().cuda()
                tzd.broadcast(b, src=0, codec=codec)
                assert same(b, xs[0])
                peer = rank ^ 1
                if rank % 2 == 0:
                    tzd.send(xs[rank].cuda(), peer, codec=codec)
                else:
                    got = tzd.recv(torch.empty(shape, dtype=dtype, device="cuda"), peer)
                    assert same(got, xs[peer])
                checked += 1
    # a CUDA tensor of several pieces (the default for CUDA tensors): the codec thread encodes on the caller's stream
    x = data(rank, (5 * tzd.PIECE_BYTES // 2 + 7,), torch.bfloat16, 90, special=False)
    plain = x.clone().cuda()
    dist.all_reduce(plain)
    for codec in ("auto", "raw", "fast"):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            t = x.cuda()
            tzd.all_reduce(t, codec=codec)
        side.synchronize()
        assert same(t, plain), ("pieces", codec)
        checked += 1
    # a DDP-sized bucket (25 MB of bf16) in one piece and in pieces, as `tzip.bench.collectives --device cuda` runs it
    x = data(rank, (25_000_000 // 2,), torch.bfloat16, 91, special=False)
    plain = x.clone().cuda()
    dist.all_reduce(plain)
    for codec in ("raw", "fast"):  # raw: the same algorithm uncompressed; with 2 ranks both equal plain PyTorch
        for piece_bytes in (0, None):
            t = x.cuda()
            tzd.all_reduce(t, codec=codec, piece_bytes=piece_bytes)
            torch.cuda.synchronize()
            assert same(t, plain), ("25 MB", codec, piece_bytes)
            checked += 1
    return checked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_over_gloo_two_ranks_one_gpu(pools):
    assert pools(2).run(w_cuda, timeout=600)[0] > 0
