"""The submission ring (protocol version 4, docs/ring.md) from the Python client, against a real `tzip serve`:

* CPU round trips through the ring for every dtype, bit-exact (integer views), with frames byte-identical to the
  ZeroMQ path's (a client with ``ring_entries=0`` on the same daemon); batches (one LINKed batch, and longer than the
  daemon's batch limit and the ring), zero-copy shared-memory tensors, ``out=``, large results; async handles
  (Futures with ``wait()``; ``concurrent.futures.wait`` completes them without anyone reaping; more in flight than
  the ring has entries);
* errors of the ring as TzipDaemonError (a corrupt frame, an SQE naming a region that is not registered), and the
  ring keeps serving; 8 client processes at once; a client SIGKILLed while it submits (the others unaffected, the
  daemon closes its ring: ``stats``); what an SQE cannot describe (more than 6 dimensions) and daemons without the
  ring (protocol version 3) go through ZeroMQ; a daemon that dies: raw frames and a warning, as before;
* GPU (skipped without CUDA, with the reason): CUDA round trips through the GPU ring, ordering both ways (a kernel
  writes the input right before the submission, another reads the result right after ``wait(stream)``), the
  process's GPU memory flat over many requests.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import signal
import subprocess
import threading
import time
import warnings

import pytest
import torch
from safetensors.torch import load_file

import tzip.client as tz
import tzip._session
from tzip import _ring
from tzip._dlpack import int_alias
from tzip._errors import DaemonUnavailableError, TzipDaemonError
from tzip.demo_data import source_weights_path

from test_client_support import (ALL_DTYPES, PYTHON, daemon, daemon_stats, run_in_threads, shared_daemon, sock_dir,  # noqa: F401
                                 wait_for)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False): run on the GPU host")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality through integer views (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(int_alias(a.detach().contiguous()).cpu(), int_alias(b.detach().contiguous()).cpu())


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


_WEIGHTS: list[torch.Tensor] = []


def weights_bf16() -> list[torch.Tensor]:
    """all-MiniLM-L6-v2's trained weight tensors, rounded to bf16 (the bundled model: tzip.demo_data), or those of the
    safetensors file $TZIP_TEST_WEIGHTS names (GPU hosts without the model's package get a few of its layers so)."""
    if not _WEIGHTS:
        w = load_file(os.environ.get("TZIP_TEST_WEIGHTS") or str(source_weights_path()))
        _WEIGHTS.extend(w[k].to(torch.bfloat16).contiguous() for k in sorted(w) if w[k].dtype == torch.float32)
    return _WEIGHTS


def embedding() -> torch.Tensor:
    """The model's word embedding, [30522, 384] bf16: its largest 2-D weight (from $TZIP_TEST_WEIGHTS' few layers, the
    largest one's rows repeated to 4096 rows, the most the tests use)."""
    w = max((w for w in weights_bf16() if w.dim() == 2), key=lambda w: w.numel())
    return w if w.shape[0] >= 4096 else w.repeat(-(-4096 // w.shape[0]), 1)[:4096].contiguous()


def record_zmq(c: tz.Client) -> list[str]:
    """The ops of every ZeroMQ message ``c`` sends from now on (the real transport still sends them)."""
    ops: list[str] = []
    request = c._session.transport.request

    def spy(msg, *args, **kwargs):
        ops.append(msg["op"])
        return request(msg, *args, **kwargs)

    c._session.transport.request = spy
    return ops


def ring_sqes(socket: str) -> int:
    """SQEs the daemon's rings completed so far (stats' ``rings.sqes``)."""
    return int(daemon_stats(socket)["rings"]["sqes"])


def settled_sqes(socket: str) -> int:
    """``ring_sqes`` once the counts of earlier requests have all arrived: two reads 50 ms apart that agree (the ring
    thread hands its counts over at most every 10 ms, so an earlier test's last SQEs may still be on the way)."""
    last = ring_sqes(socket)
    while True:
        time.sleep(0.05)
        now = ring_sqes(socket)
        if now == last:
            return now
        last = now


def sqes_since(socket: str, before: int, n: int) -> int:
    """The SQEs completed since ``before``, once they reach ``n`` (the ring thread hands its counts to JavaScript in
    batches, at most every 10 ms) or after 5 s."""
    return wait_for(lambda: ring_sqes(socket) - before >= n and ring_sqes(socket) - before, timeout=5) or ring_sqes(socket) - before


def data_ops(ops: list[str]) -> list[str]:
    return [o for o in ops if o in ("compress", "decompress")]


def test_sqe_and_cqe_layouts_are_the_contracts():
    """docs/ring.md's offsets, byte for byte (little-endian)."""
    src, dst = _ring.Region(7, 3, 1 << 20), _ring.Region(9, 5, 1 << 20)
    fields = _ring.sqe(_ring.OP_COMPRESS, _ring.F_VERIFY | _ring.F_WAIT, codec=2, dtype=8, shape=(5, 6, 7), sm_budget=10,
                       stream=1, src=(src, 0x1122, 210), dst=(dst, 0x3344, 4096), wait_value=0xAB, signal_value=0xCD)
    raw = bytearray(128)
    _ring.SQE.pack_into(raw, 0, 0x0102030405060708, *fields)
    le = lambda off, n: int.from_bytes(raw[off:off + n], "little")  # noqa: E731
    assert le(0, 8) == 0x0102030405060708
    assert list(raw[8:16]) == [1, 2 | 4, 2, 8, 3, 10, 1, 0]
    assert (le(16, 4), le(20, 4), le(24, 8), le(32, 8)) == (7, 3, 0x1122, 210)
    assert (le(40, 4), le(44, 4), le(48, 8), le(56, 8)) == (9, 5, 0x3344, 4096)
    assert [le(64 + 8 * i, 8) for i in range(6)] == [5, 6, 7, 0, 0, 0]
    assert (le(112, 8), le(120, 8)) == (0xAB, 0xCD)
    cqe = bytearray(64)
    cqe[0:8] = (42).to_bytes(8, "little")
    cqe[8:12] = (44).to_bytes(4, "little", signed=True)
    cqe[12] = 1
    cqe[16:24] = (1234).to_bytes(8, "little")
    cqe[24:24 + 11] = b"region gone"
    ud, status, codec, result, msg = _ring.CQE.unpack_from(cqe, 0)
    assert (ud, status, codec, result, msg.rstrip(b"\0")) == (42, 44, 1, 1234, b"region gone")
    err = _ring.status_error(status, "region gone", 0)
    assert isinstance(err, TzipDaemonError) and err.code == "TZIP_HANDLE" and err.index == 0
    with pytest.raises(ValueError):
        _ring.sqe(_ring.OP_COMPRESS, shape=(1,) * 7)


def test_the_ring_file_is_made_as_the_contract_says():
    name = f"tzip-{os.getpid()}-{os.urandom(8).hex()}-ring-1"
    r = _ring.Ring(name, 64)
    try:
        st = os.stat(f"/dev/shm/{name}")
        assert st.st_size == _ring.ring_bytes(64) == 4096 + 64 * 128 + 64 * 64 and oct(st.st_mode & 0o777) == "0o600"
        with open(f"/dev/shm/{name}", "rb") as f:
            head = f.read(12)
        assert head[:8] == b"TZRING01" and int.from_bytes(head[8:12], "little") == 64
        assert all(v == 0 for v in r.words().values())
    finally:
        r.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(ValueError):
        _ring.Ring(name, 48)


def test_packed_sqes_are_published_as_linked_chains_of_at_most_max_batch():
    """submit_packed (no daemon: the file's SQ read back): user_data is the request's id + the SQE's index, LINK is on
    every SQE but the last of each chain of max_batch and the last of all (whatever the caller set), sq_head counts
    them, and the SQ wraps at its end; submit() of sqe() tuples gives the same bytes."""
    name = f"tzip-{os.getpid()}-{os.urandom(8).hex()}-ring-1"
    r = _ring.Ring(name, 64, max_batch=16)
    try:
        r._head = r._tail = 50  # 14 entries before the SQ's end: the 40 SQEs wrap
        h = _ring.Handle(r, 40)
        reg = _ring.Region(3, 9, 1 << 20)
        want = [(_ring.OP_COMPRESS, 0, 1, 8, 2, 10, 1, 3, 9, 64 * k, 64, 3, 9, 4096 + 64 * k, 64, 4, 8, 0, 0, 0, 0, 0, 0)
                for k in range(40)]
        sq = bytearray(40 * _ring.SQE_BYTES)
        for k, fields in enumerate(want):
            _ring.SQE.pack_into(sq, k * _ring.SQE_BYTES, h.ud + k, fields[0], fields[1] | _ring.F_LINK, *fields[2:])
        r.submit_packed(sq, 40, h)
        assert r.words()["sq_head"] == 90 and r.in_flight == 40
        raw = bytes(r._mm[_ring.HEADER_BYTES:_ring.HEADER_BYTES + 64 * _ring.SQE_BYTES])
        for k in range(40):
            got = _ring.SQE.unpack_from(raw, ((50 + k) % 64) * _ring.SQE_BYTES)
            link = 0 if k in (15, 31, 39) else _ring.F_LINK
            assert got == (h.ud + k, want[k][0], want[k][1] | link, *want[k][2:]), k
        h2 = _ring.Handle(r, 3)
        assert h2.ud >> 32 == (h.ud >> 32) + 1 and h2.ud & 0xFFFFFFFF == 0
        r.submit([[_ring.sqe(_ring.OP_COMPRESS, codec=1, dtype=8, shape=(4, 8), src=(reg, 0, 64), dst=(reg, 64, 64))] * 3], h2)
        raw = bytes(r._mm[_ring.HEADER_BYTES:_ring.HEADER_BYTES + 64 * _ring.SQE_BYTES])
        flags = [_ring.SQE.unpack_from(raw, ((90 + k) % 64) * _ring.SQE_BYTES)[2] for k in range(3)]
        assert flags == [_ring.F_LINK, _ring.F_LINK, 0] and r.in_flight == 43
    finally:
        r.close()


def test_the_segment_table_knows_an_allocation_by_base_and_buffer_id():
    """tzip._cuda_segments.SegmentTable: an allocation made again at a freed one's base (a new buffer id) is another
    entry, and the old one's region is handed back for release; past the limit the oldest go; clear() hands back all."""
    from tzip._cuda_segments import SegmentTable, segment_key

    t = SegmentTable(limit=3)
    assert t.add(0x1000, 7) == [] and t.known(0x1000, 7) and not t.known(0x1000, 8)
    assert t.add(0x1000, 8) == [segment_key(0x1000, 7)]  # freed and made again at the same address
    assert t.known(0x1000, 8) and not t.known(0x1000, 7)
    assert t.add(0x1000, 8) == []  # the same one again: nothing to release
    assert t.add(0x2000, 1) == [] and t.add(0x3000, 2) == []
    assert t.known(0x1000, 8)  # used again: now the most recently used
    assert t.add(0x4000, 3) == [segment_key(0x2000, 1)]  # the least recently used past the limit
    assert len(t) == 3
    assert t.add(0x2000, 1) == [segment_key(0x3000, 2)] and t.add(0x3000, 2) == [segment_key(0x1000, 8)]
    t.refuse(0x5000, 4)
    assert t.was_refused(0x5000, 4) and not t.was_refused(0x5000, 5)
    assert sorted(t.clear()) == sorted([segment_key(0x2000, 1), segment_key(0x3000, 2), segment_key(0x4000, 3)])
    assert len(t) == 0 and not t.was_refused(0x5000, 4)
    # the heartbeat's sweep: what the driver says holds each base now
    for base, bid in ((0x10000, 1), (0x20000, 2), (0x30000, 3)):
        t.add(base, bid)
    now = {0x10000: (0x10000, 1), 0x20000: (0, 0), 0x30000: (0x30000, 9)}  # alive; freed; freed and made again
    assert sorted(t.sweep(lambda b: now[b])) == sorted([segment_key(0x20000, 2), segment_key(0x30000, 3)])
    assert t.known(0x10000, 1) and len(t) == 1
    assert t.sweep(lambda b: now[b]) == []


def test_a_gpu_sqes_src_and_dst_are_in_place_or_staged_in_order():
    """tzip._ring_gpu._placed: an SQE's src and dst are where the caller's memory is, or the next aligned bytes of the
    staging buffer, src before dst, each rounded up to the regions' alignment."""
    from tzip._ring_gpu import _placed
    from tzip._wire import _ALIGN

    a = _ALIGN
    assert _placed(None, 5, None, 7, 0, 3, 9) == ((3, 9, 0), (3, 9, a), 0, a, 2 * a)
    assert _placed((1, 2, 40), 5, None, 7, a, 3, 9) == ((1, 2, 40), (3, 9, a), None, a, 2 * a)
    assert _placed(None, a + 1, (4, 5, 6), 7, 0, 3, 9) == ((3, 9, 0), (4, 5, 6), 0, None, 2 * a)
    assert _placed((1, 2, 40), 5, (4, 5, 6), 7, 3 * a, 3, 9) == ((1, 2, 40), (4, 5, 6), None, None, 3 * a)


@pytest.fixture(scope="module")
def clients(shared_daemon):
    """(ring client, ZeroMQ-only client) on the module's daemon."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ring = tz.connect(shared_daemon.socket, spawn=False, strict=True)
        plain = tz.connect(shared_daemon.socket, spawn=False, strict=True, ring_entries=0)
    yield ring, plain
    ring.close()
    plain.close()


def test_hello_offers_the_ring_and_the_client_opens_one_for_cpu_tensors(clients, shared_daemon):
    ring, plain = clients
    assert ring.protocol_version == 4
    info = ring.ring_info
    assert info["offered"]["sqe_bytes"] == 128 and info["offered"]["cqe_bytes"] == 64
    ring.compress(torch.ones(4))
    info = ring.ring_info
    assert info["rings"]["cpu"]["state"] == "serving" and info["rings"]["cpu"]["entries"] == tz.RING_ENTRIES
    assert os.path.exists(f"/dev/shm/{info['rings']['cpu']['file']}")
    assert plain.ring_info["rings"] == {}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_through_the_ring_bit_exact_with_the_zeromq_paths_frames(clients, shared_daemon, dtype):
    ring, plain = clients
    t = random_tensor(dtype, (3, 5, 64), seed=hash(str(dtype)) & 0xFFFF)
    ops = record_zmq(ring)
    before = settled_sqes(shared_daemon.socket)
    ct = ring.compress(t)
    back = ring.decompress(ct)
    assert data_ops(ops) == []  # not a ZeroMQ compress or decompress: the ring carried both
    assert sqes_since(shared_daemon.socket, before, 2) == 2
    assert same_bits(back, t)
    ref = plain.compress(t)
    assert ct.codec == ref.codec
    assert ct.payload.numpy().tobytes() == ref.payload.numpy().tobytes()
    assert same_bits(plain.decompress(ct), t) and same_bits(ring.decompress(ref), t)


@pytest.mark.parametrize("codec", ["fast", "max", "raw", "bytes", "auto"])
def test_real_weights_round_trip_with_every_codec(clients, codec):
    ring, plain = clients
    ws = weights_bf16()[:20]
    cts = ring.compress(ws, codec=codec)
    refs = plain.compress(ws, codec=codec)
    assert [c.payload.numpy().tobytes() for c in cts] == [c.payload.numpy().tobytes() for c in refs]
    assert [c.codec for c in cts] == [c.codec for c in refs]
    for w, b in zip(ws, ring.decompress(cts)):
        assert same_bits(b, w)
    if codec in ("fast", "max"):
        assert sum(c.payload.numel() for c in cts) < sum(w.numel() * 2 for w in ws)


def test_batches_longer_than_a_batch_and_than_the_ring(shared_daemon):
    """1500 tensors: more than the daemon's max_batch (1024) and than a small ring's entries (16): split into LINKed
    batches, the submitter reaping while the ring is full."""
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True, ring_entries=16)
    try:
        ws = [w.reshape(-1) for w in weights_bf16() if w.numel() >= 1000]
        ts = [ws[i % len(ws)][(i * 7) % 500 : (i * 7) % 500 + 1 + i % 97].clone() for i in range(1500)]
        before = settled_sqes(shared_daemon.socket)
        cts = c.compress(ts, codec="fast")
        backs = c.decompress(cts)
        assert sqes_since(shared_daemon.socket, before, 3000) == 3000
        assert all(same_bits(b, t) for b, t in zip(backs, ts))
        assert c.ring_info["rings"]["cpu"]["entries"] == 16
    finally:
        c.close()


def test_views_non_contiguous_zero_copy_out_and_large_results(clients):
    ring, plain = clients
    w = embedding()
    view = w[100:300, 7:200]  # not contiguous
    offset_view = w.reshape(-1)[12345:67890]  # a storage offset
    shm = ring.empty((4096, 384), torch.bfloat16)
    shm.copy_(w[:4096])
    big = w[:3000].clone()  # 2.3 MB: the result gets a shared-memory segment of its own
    cts = ring.compress([view, offset_view, shm, big])
    assert [c.payload.numpy().tobytes() for c in cts] == [c.payload.numpy().tobytes() for c in plain.compress([view, offset_view, shm.clone(), big])]
    backs = ring.decompress(cts)
    for b, t in zip(backs, [view, offset_view, shm, big]):
        assert same_bits(b, t)
    out_plain = torch.empty_like(view)
    out_shm = ring.empty(tuple(shm.shape), shm.dtype)
    out_strided = torch.empty(view.shape[1], view.shape[0], dtype=view.dtype).t()  # non-contiguous out=
    got = ring.decompress([cts[0], cts[2], cts[0]], out=[out_plain, out_shm, out_strided])
    assert got[0] is out_plain and got[1] is out_shm and got[2] is out_strided
    assert same_bits(out_plain, view) and same_bits(out_shm, shm) and same_bits(out_strided, view)
    assert same_bits(ring.decompress(cts[1], verify=False), offset_view)


def test_async_handles_are_futures_and_complete_without_anyone_waiting(clients, shared_daemon):
    ring, _ = clients
    ws = weights_bf16()[:30]
    h = ring.compress_async(ws[0])
    assert isinstance(h, concurrent.futures.Future) and isinstance(h, _ring.Handle)
    assert not h.cancel()
    ct = h.result(timeout=30)
    h.wait()  # a CPU request: returns once it is done
    assert same_bits(ring.decompress_async(ct).result(timeout=30), ws[0])
    # Nobody calls result(): concurrent.futures.wait and the done callbacks see them complete (the background reaper).
    seen: list[int] = []
    hs = [ring.compress_async(w, codec="fast") for w in ws]
    for i, x in enumerate(hs):
        x.add_done_callback(lambda _f, i=i: seen.append(i))
    done, not_done = concurrent.futures.wait(hs, timeout=30)
    assert not not_done and sorted(seen) == list(range(len(ws)))
    backs = [ring.decompress_async(x.result()) for x in hs]
    for b, w in zip(concurrent.futures.as_completed(backs, timeout=30), ws):
        pass
    for b, w in zip(backs, ws):
        assert same_bits(b.result(), w)


def test_more_requests_in_flight_than_the_ring_has_entries(shared_daemon):
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True, ring_entries=8)
    try:
        ws = weights_bf16()[:40]
        hs = [c.compress_async(w[:50]) for w in ws] + [c.compress_async(ws[:12])]
        cts = [h.result(timeout=60) for h in hs]
        for ct, w in zip(cts[:-1], ws):
            assert same_bits(c.decompress(ct), w[:50])
        for ct, w in zip(cts[-1], ws[:12]):
            assert same_bits(c.decompress(ct), w)
    finally:
        c.close()


def test_many_threads_share_one_ring(clients):
    """Any thread that waits reaps for all: 4 threads, each with its own requests, all complete and match."""
    ring, _ = clients
    ws = weights_bf16()[:16]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(25):
                t = ws[(k + i) % len(ws)][: 10 + i]
                if not same_bits(ring.decompress(ring.compress(t)), t):
                    raise AssertionError(f"thread {k} request {i} differs")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    run_in_threads(worker, 4, 120)
    assert not errors, errors


def test_ring_errors_are_tzip_daemon_errors_and_the_ring_keeps_serving(clients):
    ring, _ = clients
    w = embedding()[:2000]
    ct = ring.compress(w, codec="max")
    bad = ct.payload.clone()
    bad[-10] ^= 0x55  # a flipped bit in the last chunk's payload
    with pytest.raises(TzipDaemonError) as e:
        ring.decompress(tz.CompressedTensor(bad, ct.dtype, ct.shape, ct.codec, ct.nbytes))
    assert e.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT")
    # An SQE naming a region that is not registered: a CQE with TZIP_HANDLE (44), mapped by the error table.
    r = ring._rings[None]
    h = _ring.Handle(r, 1, None)
    ghost = _ring.Region(4000, 7, 1 << 20)
    r.submit([[_ring.sqe(_ring.OP_COMPRESS, codec=1, dtype=8, shape=(8,), src=(ghost, 0, 16), dst=(ghost, 4096, 4096))]], h)
    (status, _codec, _result, message), = h.result(timeout=10)
    assert status == 44
    err = _ring.Handle.error_of(h.cqes)
    assert isinstance(err, TzipDaemonError) and err.code == "TZIP_HANDLE" and err.index == 0
    # A nop, and real work afterwards.
    nop = _ring.Handle(r, 1, None)
    r.submit([[_ring.sqe(_ring.OP_NOP)]], nop)
    assert nop.result(timeout=10)[0][0] == 0
    assert same_bits(ring.decompress(ring.compress(w)), w)
    assert ring.ring_info["rings"]["cpu"]["state"] == "serving"


def test_empty_calls_and_tensors_without_bytes(clients):
    ring, plain = clients
    assert ring.compress([]) == [] and ring.decompress([]) == []
    assert ring.compress_async([]).result(timeout=10) == [] and ring.decompress_async([]).result(timeout=10) == []
    e = torch.empty(0, 3, dtype=torch.bfloat16)
    cts = ring.compress([e, embedding()[0]])  # a tensor without bytes: the call goes through ZeroMQ
    assert cts[0].payload.numpy().tobytes() == plain.compress(e).payload.numpy().tobytes()
    backs = ring.decompress(cts)
    assert backs[0].shape == (0, 3) and same_bits(backs[1], embedding()[0])


def test_a_broken_ring_sends_the_client_to_zeromq_and_is_closed(daemon):
    """Indices out of range (sq_head more than `entries` past sq_tail): the daemon marks the ring broken; the client
    goes on through ZeroMQ, bit-exact, and closes the broken ring in the daemon (ring_close)."""
    c = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        w = embedding()[:300]
        assert same_bits(c.decompress(c.compress(w)), w)
        r = c._rings[None]
        base = daemon_stats(daemon.socket)["rings"]
        r._sq_head.value = (r._head + r.entries + 5) & 0xFFFFFFFF  # a torn / hostile index
        r.ring_doorbell()
        assert wait_for(lambda: r.words()["state"] == _ring.STATE_BROKEN, 10), r.words()
        ops = record_zmq(c)
        assert same_bits(c.decompress(c.compress(w)), w)
        assert data_ops(ops) == ["compress", "decompress"]
        assert "cpu" in c.ring_info["refused"] and "cpu" not in c.ring_info["rings"]
        c.compress(w)  # closes the retired ring
        assert wait_for(lambda: daemon_stats(daemon.socket)["rings"]["open"] == base["open"] - 1, 10)
        assert daemon_stats(daemon.socket)["rings"]["broken"] == base["broken"] + 1
        assert not os.path.exists(f"/dev/shm/{r.name}")
    finally:
        c.close()


def test_a_frame_of_more_than_six_dimensions_goes_through_zeromq(clients):
    ring, _ = clients
    t = random_tensor(torch.float16, (2, 1, 3, 1, 2, 2, 5), seed=4)
    ops = record_zmq(ring)
    ct = ring.compress(t)
    assert "compress" in ops
    assert same_bits(ring.decompress(ct), t)
    assert ops.count("decompress") == 0  # decompress needs no shape in the SQE: the ring carried it


def test_a_daemon_without_the_ring_is_spoken_to_over_zeromq(daemon, monkeypatch):
    monkeypatch.setattr(tzip._session, "PROTOCOL_VERSIONS", [1, 2, 3])
    c = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        assert c.protocol_version == 3 and c.ring_info["offered"] is None
        ops = record_zmq(c)
        ws = weights_bf16()[:5]
        cts = c.compress(ws)
        backs = c.decompress_async(cts).result(timeout=30)
        assert ops.count("compress") == 1 and ops.count("decompress") == 1
        assert all(same_bits(b, w) for b, w in zip(backs, ws))
        assert not any(n.startswith(c.shm_prefix + "ring-") for n in os.listdir("/dev/shm"))
    finally:
        c.close()


_WORKER = r"""
import sys, torch, tzip.client as tz
from tzip._dlpack import int_alias
sock, k = sys.argv[1], int(sys.argv[2])
c = tz.connect(sock, spawn=False, strict=True)
g = torch.Generator().manual_seed(k)
for i in range(40):
    t = (torch.randn(1 + 97 * i, generator=g) * 0.02).to(torch.bfloat16 if i % 2 else torch.float32)
    back = c.decompress(c.compress(t, codec="fast"))
    assert torch.equal(int_alias(back), int_alias(t)), (k, i)
assert c.ring_info["rings"]["cpu"]["state"] == "serving", c.ring_info
c.close()
print("ok", k)
"""


def test_eight_client_processes_at_once(daemon):
    before = daemon_stats(daemon.socket)["rings"]
    procs = [subprocess.Popen([PYTHON, "-c", _WORKER, daemon.socket, str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in range(8)]
    outs = [p.communicate(timeout=240) for p in procs]
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.decode().strip() == f"ok {k}", err.decode()[-2000:]
    after = daemon_stats(daemon.socket)["rings"]
    assert after["opened"] - before["opened"] == 8
    assert sqes_since(daemon.socket, before["sqes"], 8 * 80) >= 8 * 80
    assert wait_for(lambda: daemon_stats(daemon.socket)["rings"]["open"] == before["open"], timeout=10)


_SUBMITTER = r"""
import sys, torch, tzip.client as tz
c = tz.connect(sys.argv[1], spawn=False, strict=True)
t = (torch.randn(50_000) * 0.02).to(torch.bfloat16)
c.compress(t)
print(c.ring_info["rings"]["cpu"]["file"], flush=True)
while True:  # submissions without end, never reaped: killed in the middle of one
    hs = [c.compress_async(t[: 1000 + i]) for i in range(64)]
    for h in hs[:32]:
        h.result()
"""


def test_a_client_killed_mid_submission_leaves_the_others_unaffected_and_its_ring_closed(daemon):
    ours = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        w = embedding().reshape(-1)[:100_000]
        assert same_bits(ours.decompress(ours.compress(w)), w)
        base = daemon_stats(daemon.socket)["rings"]["open"]
        p = subprocess.Popen([PYTHON, "-c", _SUBMITTER, daemon.socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            ring_file = p.stdout.readline().decode().strip()
            assert ring_file, p.stderr.read().decode()[-2000:]
            assert daemon_stats(daemon.socket)["rings"]["open"] == base + 1
            time.sleep(0.5)
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        # We keep being served, while and after the daemon notices the dead client (its lease: 2 s).
        for i in range(20):
            t = w[i : i + 500 + 37 * i]
            assert same_bits(ours.decompress(ours.compress(t)), t)
        assert wait_for(lambda: daemon_stats(daemon.socket)["rings"]["open"] == base, timeout=20), daemon_stats(daemon.socket)["rings"]
        assert wait_for(lambda: not os.path.exists(f"/dev/shm/{ring_file}"), timeout=20)
        assert same_bits(ours.decompress(ours.compress(w)), w)
        assert ours.ring_info["rings"]["cpu"]["state"] == "serving"
    finally:
        ours.close()


def test_a_daemon_that_dies_gives_raw_frames_and_a_warning_and_strict_raises(daemon):
    lax = tz.connect(daemon.socket, spawn=False, strict=False)
    strict = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        w = embedding().reshape(-1)[:2000]
        assert lax.compress(w).codec != "raw" and strict.compress(w).codec != "raw"
        daemon.kill()
        with pytest.warns(RuntimeWarning, match="not available"):
            ct = lax.compress(w)
        assert ct.codec == "raw" and same_bits(lax.decompress(ct), w)
        with pytest.raises(DaemonUnavailableError):
            strict.compress(w)
        with pytest.raises(DaemonUnavailableError):
            strict.compress_async(w).result(timeout=30)
    finally:
        lax.close()
        strict.close()


def kill_when_the_ring_is_busy(c: tz.Client, pid: int, box: dict) -> threading.Thread:
    """A thread that SIGKILLs the daemon ``pid`` once its ring thread took an SQE of ``c``'s CPU ring and has not
    completed it (sq_tail past cq_head in the ring file's header)."""

    def run() -> None:
        try:
            def busy():
                ring = c._rings.get(None)
                w = ring.words() if ring is not None else None
                return w is not None and w["sq_tail"] == w["sq_head"] and w["cq_head"] != w["sq_tail"]
            wait_for(busy, 60, 0.001)
        finally:
            box["killed"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_a_daemon_killed_mid_ring_request(daemon, strict):
    """The request in the ring thread's hands when the daemon dies: a lenient client stores raw frames (one warning), a
    strict one raises DaemonUnavailableError, both within seconds; nothing hangs."""
    c = tz.connect(daemon.socket, spawn=False, strict=strict)
    try:
        big = embedding().reshape(-1).repeat(2)[: 12 << 20].clone()  # 24 MiB of trained bf16 weights
        c.compress(big[:1000])
        box: dict = {}
        th = kill_when_the_ring_is_busy(c, daemon.pid, box)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ct = c.compress(big, codec="max")
                got = ct.codec
            except DaemonUnavailableError:
                got = "DaemonUnavailableError"
        done = time.monotonic()
        th.join(10)
        daemon.proc.wait(10)
        assert got == ("DaemonUnavailableError" if strict else "raw")
        assert done - box["killed"] < 5.0
        if not strict:
            assert any("not available" in str(w.message) for w in caught)
            assert same_bits(c.decompress(ct), big)
    finally:
        c.close()


def test_a_spawning_client_redoes_a_ring_request_cut_by_a_daemon_crash(sock_dir):
    sock = os.path.join(sock_dir, "sp", "tzip.sock")
    c = tz.connect(sock, spawn=True, strict=True)
    try:
        first = c.daemon_info["pid"]
        big = embedding().reshape(-1).repeat(2)[: 12 << 20].clone()
        c.compress(big[:1000])
        box: dict = {}
        th = kill_when_the_ring_is_busy(c, first, box)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: a new daemon is started within the same call
            ct = c.compress(big, codec="max")
        th.join(10)
        assert ct.codec == "max" and c.daemon_info["pid"] != first
        assert same_bits(c.decompress(ct), big)
        c.compress(big[:1000])
        assert c.ring_info["rings"]["cpu"]["state"] == "serving"  # a ring of the new session
        c.shutdown_daemon()
    finally:
        c.close()


def test_closing_the_client_finishes_the_requests_in_flight_first(shared_daemon):
    """close() with async ring requests in flight: each handle still gives its frames (bit-exact round trips), as
    the ZeroMQ path's worker threads finish theirs; none fails on the session the close ended."""
    ws = [w for w in weights_bf16() if w.numel() >= 100_000][:6]
    with tz.connect(shared_daemon.socket, spawn=False, strict=True) as check:
        for round_ in range(3):
            c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
            hs = [c.compress_async(w) for w in ws]
            time.sleep(0.02 * round_)
            c.close()
            for h, w in zip(hs, ws):
                assert same_bits(check.decompress(h.result(timeout=30)), w)


def test_closing_the_client_closes_its_rings_and_removes_the_files(shared_daemon):
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    c.compress(torch.ones(3))
    f = c.ring_info["rings"]["cpu"]["file"]
    open_before = daemon_stats(shared_daemon.socket)["rings"]["open"]
    c.close()
    assert not os.path.exists(f"/dev/shm/{f}")
    assert wait_for(lambda: daemon_stats(shared_daemon.socket)["rings"]["open"] == open_before - 1, timeout=10)


# --- GPU (the lead runs these on the H200) -------------------------------------------------------------------------
def connect_gpu_client(socket: str) -> tz.Client:
    """A client of the daemon at ``socket`` for GPU tests; skips the test without a GPU here or in the daemon."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False): run on the GPU host")
    c = tz.connect(socket, spawn=False, strict=True)
    if not c.daemon_info.get("gpu"):
        c.close()
        pytest.skip(f"the daemon serves no GPU: {c.daemon_info.get('gpu_reason')}")
    return c


@pytest.fixture(scope="module")
def gpu_client(shared_daemon):
    c = connect_gpu_client(shared_daemon.socket)
    yield c
    c.close()


@needs_cuda
def test_cuda_round_trips_through_the_gpu_ring(gpu_client):
    c = gpu_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        ts = [w.cuda() for w in weights_bf16() if w.dim() == 2][:12] + [random_tensor(d, (7, 33), seed=1).cuda() for d in
                                                       (torch.float32, torch.float16, torch.int8, torch.int64, torch.bool)]
        ops = record_zmq(c)
        cts = c.compress(ts, codec="fast")
        backs = c.decompress(cts)
        torch.cuda.synchronize()
        assert data_ops(ops) == [], ops
        assert c.ring_info["rings"]["cuda:0"]["state"] == "serving"
        assert all(ct.payload.device.type == "cuda" for ct in cts)
        for b, t in zip(backs, ts):
            assert same_bits(b, t)
        refs = plain.compress(ts, codec="fast")
        assert [x.payload.cpu().numpy().tobytes() for x in cts] == [x.payload.cpu().numpy().tobytes() for x in refs]
        # out= (contiguous and not), and async handles with wait(stream)
        out = torch.empty_like(ts[0])
        strided = torch.empty(ts[1].shape[1], ts[1].shape[0], dtype=ts[1].dtype, device="cuda").t()
        h = c.decompress_async([cts[0], cts[1]], out=[out, strided])
        h.wait()
        got = h.result(timeout=60)
        torch.cuda.synchronize()
        assert got[0] is out and same_bits(out, ts[0]) and same_bits(strided, ts[1])
    finally:
        plain.close()


@needs_cuda
def test_gpu_ordering_both_ways_many_iterations(gpu_client):
    """A kernel writes the input on a side stream right before the submission; another kernel reads the result right
    after wait(stream): no host synchronisation in between, every round trip bit-exact."""
    c = gpu_client
    s = torch.cuda.Stream()

    def round_trip(x):
        d = c.decompress_async(c.compress_async(x, codec="fast").result())
        d.wait(s)  # a GPU-side wait: the next kernel on s reads the decompressed tensor
        return d.result()

    bad = ordering_failures(s, embedding().cuda().reshape(-1)[:300_000],
                            int(os.environ.get("TZIP_RING_ORDER_ITERS", "10000")), round_trip)
    assert not bad, bad[:10]


def ordering_failures(s: torch.cuda.Stream, base: torch.Tensor, n: int, round_trip) -> list[int]:
    """``n`` round trips on stream ``s`` of a bf16 input that kernels on ``s`` write right before each call (``base``,
    element i % numel set to i % 251), checked by a kernel on ``s`` right after it (no host synchronisation in
    between): the iterations whose result (``round_trip(x)``) is not bit-exact."""
    bad = []
    with torch.cuda.stream(s):
        x = torch.empty_like(base)
        for i in range(n):
            x.copy_(base)
            x[i % x.numel()] = float(i % 251)  # the producer kernel, right before the submission
            want = x.clone()
            y = round_trip(x)
            if not torch.equal(y.view(torch.int16), want.view(torch.int16)):  # the consumer kernel, on s
                bad.append(i)
    torch.cuda.synchronize()
    return bad


@needs_cuda
def test_gpu_memory_stays_flat_over_many_requests(gpu_client):
    c = gpu_client
    t = embedding()[:4096].cuda()
    small = t.reshape(-1)[:999].clone()
    for _ in range(50):
        c.decompress(c.compress([t, small]))
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for _ in range(int(os.environ.get("TZIP_RING_MEMORY_ITERS", "10000")) // 10 * 10):
        cts = c.compress([t, small])
        c.decompress(cts)
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() - before <= 4 << 20, (before, torch.cuda.memory_allocated())


@needs_cuda
def test_gpu_handles_finished_by_the_background_reaper(gpu_client):
    """Nobody calls result() until the handles are done, so the ring's reaper thread, which never made a CUDA call of
    its own, runs their finishing steps (a GPU-side wait on the done word, through the driver API). That thread had
    no current context: bench_daemon --cuda failed there with CUDA_ERROR_INVALID_CONTEXT before _memops made the
    stream's primary context current."""
    c = gpu_client
    ts = [w.cuda() for w in weights_bf16() if w.dim() == 2][:3] + [torch.arange(1, dtype=torch.float32, device="cuda")]
    for _ in range(20):
        h = c.compress_async(ts, codec="fast")
        assert wait_for(h.done, timeout=30)
        cts = h.result()
        d = c.decompress_async(cts)
        assert wait_for(d.done, timeout=30)
        backs = d.result()
        torch.cuda.synchronize()
        assert all(same_bits(b, t) for b, t in zip(backs, ts))


def count_copies(monkeypatch) -> dict[str, int]:
    """Counts the client's GPU copies from now on: {"raw": single-range copies (copy_raw), "many": gpu_copy_many
    calls} of the general ring path and the one-tensor path."""
    from tzip import _ring_gpu, _ring_one

    copies = {"raw": 0, "many": 0}
    raw, many = _ring_gpu.copy_raw, _ring_gpu.gpu_copy_many

    def count_raw(*a):
        copies["raw"] += 1
        return raw(*a)

    def count_many(*a):
        copies["many"] += 1
        return many(*a)

    monkeypatch.setattr(_ring_gpu, "copy_raw", count_raw)
    monkeypatch.setattr(_ring_one, "copy_raw", count_raw)
    monkeypatch.setattr(_ring_gpu, "gpu_copy_many", count_many)
    return copies


@needs_cuda
def test_gpu_ring_reads_and_writes_the_callers_memory_in_place(gpu_client, monkeypatch):
    """Contiguous CUDA tensors, frames and results are named in the caller's own allocations, registered on the ring
    once (tzip._cuda_segments): a compress copies only its frames (out of the frame bound's payload on the one-tensor
    path, tzip._ring_one, or out of the staging buffer), a decompress copies nothing; a non-contiguous tensor in the
    same batch is staged. Bit-exact both ways, the frames the ZeroMQ path's."""
    from tzip import _memops

    c = gpu_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        one = random_tensor(torch.bfloat16, (1000, 300), seed=3).cuda()
        c.decompress(c.compress(one))  # registers the allocations used below
        torch.cuda.synchronize()
        copies = count_copies(monkeypatch)
        ct = c.compress(one, codec="fast")
        assert copies == {"raw": 1, "many": 0}  # the frame into a payload of its size, nothing in
        back = c.decompress(ct)
        out = torch.empty_like(one)
        c.decompress(ct, out=out)
        torch.cuda.synchronize()
        assert copies == {"raw": 1, "many": 0}, copies  # frames read and results written in place
        assert same_bits(back, one) and same_bits(out, one)
        ring = c._rings[0]
        for t in (one, ct.payload, back, out):
            a = _memops.allocation_of(t.data_ptr(), 0)
            assert a.ipc and ring.segments.known(a.base, a.buffer_id)
        # a batch with a view at an odd offset (in place) and a non-contiguous tensor (staged)
        w = random_tensor(torch.float32, (64, 48), seed=4).cuda()
        ts = [one, w.t(), w.reshape(-1)[7:1007], random_tensor(torch.int8, (5, 7), seed=5).cuda()]
        cts = c.compress(ts, codec="fast")
        backs = c.decompress(cts)
        torch.cuda.synchronize()
        assert all(same_bits(b, t) for b, t in zip(backs, ts))
        refs = plain.compress(ts, codec="fast")
        assert [x.payload.cpu().numpy().tobytes() for x in cts] == [x.payload.cpu().numpy().tobytes() for x in refs]
    finally:
        plain.close()


@needs_cuda
def test_a_segment_freed_and_made_again_at_its_address_is_registered_anew(gpu_client):
    """The caching allocator frees a segment (torch.cuda.empty_cache) and a new one may get its address: the
    registration is known by (base, buffer id), so requests on the new memory never use the old registration, the old
    one is released, and every round trip stays bit-exact. release_gpu() lets go of them all; later requests register
    again."""
    from tzip import _memops

    c = gpu_client
    ring = c._rings.ring(0)  # opened here when no earlier test of the module opened it
    assert ring is not None, c.ring_info
    seen: list[tuple[int, int]] = []
    again = 0  # allocations made at the base of one freed before
    for i in range(6):
        # 16 MB (above the caching allocator's 10 MiB: a segment of its own, freed by empty_cache once unused)
        x = random_tensor(torch.bfloat16, (8000, 1000), seed=10 + i).cuda()
        a = _memops.allocation_of(x.data_ptr(), 0)
        back = c.decompress(c.compress(x, codec="fast"))
        torch.cuda.synchronize()
        assert same_bits(back, x), i
        assert ring.segments.known(a.base, a.buffer_id)
        for base, bid in seen:
            if base == a.base and bid != a.buffer_id:
                again += 1
                assert not ring.segments.known(base, bid)  # the old one is forgotten (its region released)
        seen.append((a.base, a.buffer_id))
        del x, back
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    assert again >= 1, seen  # the driver gave a freed segment's address to a new one at least once
    assert c.release_gpu() >= 1
    assert len(ring.segments) == 0
    y = random_tensor(torch.float16, (777,), seed=20).cuda()
    assert same_bits(c.decompress(c.compress(y)), y)
    assert len(ring.segments) >= 1


@needs_cuda
def test_gpu_ordering_when_the_submitting_stream_changes(shared_daemon):
    """The ring's produced word is written by the one stream that has submitted so far, and through the ring's own
    stream once a second one submits (tzip._ring_gpu.RingGpu._gpu_submit): a fresh client submits from stream A, then from B
    and A in turn, each right after a kernel that writes the input on that stream; every round trip bit-exact."""
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    try:
        if not c.daemon_info.get("gpu"):
            pytest.skip(f"the daemon serves no GPU: {c.daemon_info.get('gpu_reason')}")
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        base = embedding().cuda().reshape(-1)[:200_000]
        torch.cuda.synchronize()
        xs = {id(a): torch.empty_like(base), id(b): torch.empty_like(base)}
        bad = []
        for i in range(300):
            s = a if i < 20 or i % 3 else b
            with torch.cuda.stream(s):
                x = xs[id(s)]
                x.copy_(base)
                x[i % x.numel()] = float(i % 251)  # the producer kernel, right before the submission
                want = x.clone()
                ct = c.compress_async(x, codec="fast").result()
                d = c.decompress_async(ct)
                d.wait(s)
                y = d.result()
                if not torch.equal(y.view(torch.int16), want.view(torch.int16)):
                    bad.append(i)
        torch.cuda.synchronize()
        assert not bad, bad[:10]
        assert c._rings[0].home_stream is False  # the second stream switched the ring to its own stream
    finally:
        c.close()
