"""The lean path of blocking single-tensor GPU calls through the ring (tzip._ring_one): which calls take it, that they
round-trip bit-exact with the frames of the ZeroMQ path, stream order both ways without host synchronisation, flat
memory, and the finishing step's outcomes (on the CPU). The GPU tests skip with the reason without a GPU."""

from __future__ import annotations

import gc
import os

import pytest
import torch

import tzip.client as tz
from tzip import _ring
from tzip._errors import DaemonUnavailableError, TzipDaemonError
from tzip._ring_one import _AGAIN, _outcome

from test_client_support import shared_daemon  # noqa: F401
from test_ring import connect_gpu_client, count_copies, data_ops, embedding, needs_cuda, ordering_failures, random_tensor, record_zmq, same_bits


def test_the_outcome_of_a_one_sqe_request():
    """A good CQE gives the check's value; a ring that stopped, a daemon gone or a region released while queued
    (TZIP_HANDLE) give _AGAIN (the call is done again without the ring); any other CQE error raises its code."""
    seen = []

    def check(codec, result):
        seen.append((codec, result))
        return "value"

    assert _outcome([(0, 1, 40, "")], check) == "value" and seen == [(1, 40)]
    assert _outcome(_ring.RingClosed("the ring stopped"), check) is _AGAIN
    assert _outcome(DaemonUnavailableError("gone"), check) is _AGAIN
    assert _outcome([(_ring.ERROR_CODES["TZIP_HANDLE"], 0, 0, "region 3 was released")], check) is _AGAIN
    with pytest.raises(TzipDaemonError) as e:
        _outcome([(_ring.ERROR_CODES["TZIP_CORRUPT"], 0, 0, "bad frame")], check)
    assert e.value.code == "TZIP_CORRUPT"
    with pytest.raises(ValueError):
        _outcome(ValueError("a bug of the finishing step"), check)  # not a ring outcome: raised as it is
    assert len(seen) == 1


@pytest.fixture(scope="module")
def one_client(shared_daemon):  # noqa: F811
    c = connect_gpu_client(shared_daemon.socket)
    c.decompress(c.compress(torch.ones(4, device="cuda")))  # opens the GPU ring (the lean path never opens one)
    yield c
    c.close()


def _general_path_refused(c: tz.Client, monkeypatch) -> None:
    """Makes the general ring path fail the test if a call reaches it."""
    def refuse(*_a, **_k):
        raise AssertionError("the call took the general ring path")

    monkeypatch.setattr(c, "_compress_submit", refuse)
    monkeypatch.setattr(c, "_decompress_submit", refuse)


@needs_cuda
def test_one_small_cuda_tensor_takes_the_lean_path_both_ways(one_client, monkeypatch):
    c = one_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        w = random_tensor(torch.float32, (64, 48), seed=4).cuda()
        ts = [torch.ones(1, dtype=torch.bfloat16, device="cuda"), torch.tensor(-0.0, device="cuda"),
              w.reshape(-1)[7:107]]  # a view at an odd offset in a larger allocation
        ts += [random_tensor(d, (7, 33), seed=1).cuda() for d in
               (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64, torch.bool)]
        refs = [plain.compress(t, codec=codec) for t in ts for codec in ("fast", "raw")]
        torch.cuda.synchronize()
        _general_path_refused(c, monkeypatch)
        ops = record_zmq(c)
        cts = [c.compress(t, codec=codec) for t in ts for codec in ("fast", "raw")]
        backs = [c.decompress(ct) for ct in cts]
        outs = [torch.empty_like(t) for t in ts for _ in range(2)]
        into = [c.decompress(ct, out=o, verify=False) for ct, o in zip(cts, outs)]
        torch.cuda.synchronize()
        assert data_ops(ops) == [], ops
        for k, (ct, ref) in enumerate(zip(cts, refs)):
            t = ts[k // 2]
            assert ct.payload.device == t.device and ct.codec == ref.codec and ct.nbytes == t.nbytes
            assert ct.payload.cpu().numpy().tobytes() == ref.payload.cpu().numpy().tobytes(), k
            assert same_bits(backs[k], t) and into[k] is outs[k] and same_bits(outs[k], t), k
        # A large tensor too: its frame is copied out of the frame bound's payload into one of its exact size (no
        # more memory held than the frame's); a frame of a large tensor is read in place (the result new, or out=).
        big = random_tensor(torch.bfloat16, (1000, 300), seed=3).cuda()
        ref = plain.compress(big, codec="fast").payload.cpu().numpy().tobytes()
        ct = c.compress(big, codec="fast")
        assert ct.payload.cpu().numpy().tobytes() == ref
        assert ct.payload.untyped_storage().nbytes() == ct.payload.numel() == len(ref)
        out = torch.empty_like(big)
        assert same_bits(c.decompress(ct), big) and same_bits(c.decompress(ct, out=out), big)
        torch.cuda.synchronize()
        assert data_ops(ops) == [], ops
    finally:
        plain.close()


@needs_cuda
def test_calls_the_lean_path_does_not_take_go_the_general_way(one_client, monkeypatch):
    """Non-contiguous tensors, a result on another layout, batches and asynchronous calls: the general ring path,
    bit-exact as before."""
    c = one_client
    taken = []
    for name in ("_compress_submit", "_decompress_submit"):
        real = getattr(c, name)

        def spy(*a, _real=real, _name=name, **k):
            taken.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(c, name, spy)
    w = random_tensor(torch.bfloat16, (64, 48), seed=6).cuda()
    taken.clear()
    assert same_bits(c.decompress(c.compress(w.t())), w.t())
    assert taken[0] == "_compress_submit", taken
    ct = c.compress(w)
    taken.clear()
    strided = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device="cuda").t()
    assert c.decompress(ct, out=strided) is strided and same_bits(strided, w)
    assert taken == ["_decompress_submit"], taken
    taken.clear()
    assert same_bits(c.decompress([c.compress([w])[0]])[0], w) and taken == ["_compress_submit", "_decompress_submit"]
    taken.clear()
    assert same_bits(c.decompress_async(c.compress_async(w).result()).result(), w)
    torch.cuda.synchronize()


@needs_cuda
def test_compress_into_out_is_written_in_place_on_the_gpu(one_client, monkeypatch):
    """compress(t, out=) of one CUDA tensor: the daemon writes the frame at the start of out (the payload a view of
    it), the bytes of the ZeroMQ path's frame, nothing written past out, no ZeroMQ data request; small and large
    tensors, views at odd offsets, every codec the ring takes; and a batch through the general ring path."""
    c = one_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        w = embedding().cuda()
        ts = [torch.ones(1, dtype=torch.bfloat16, device="cuda"), w.reshape(-1)[3:1003], w[:1000], w,
              random_tensor(torch.float32, (257, 129), seed=9).cuda()]
        cases = [(t, codec) for t in ts for codec in ("fast", "raw", "max")]
        refs = [plain.compress(t, codec=codec).payload.cpu().numpy().tobytes() for t, codec in cases]
        torch.cuda.synchronize()
        copies = count_copies(monkeypatch)
        _general_path_refused(c, monkeypatch)
        ops = record_zmq(c)
        for (t, codec), ref in zip(cases, refs):
            bound = tz.Client.frame_bound(t)
            arena = torch.full((bound + 4096,), 0xAB, dtype=torch.uint8, device="cuda")
            ct = c.compress(t, codec=codec, out=arena[:bound])
            assert ct.payload.data_ptr() == arena.data_ptr() and ct.payload.cpu().numpy().tobytes() == ref, (t.shape, codec)
            assert bool((arena[bound:] == 0xAB).all()), (t.shape, codec)
            assert same_bits(c.decompress(ct), t), (t.shape, codec)
            ct = c.compress(t, codec=codec, out=arena)  # a buffer larger than the bound
            assert ct.payload.data_ptr() == arena.data_ptr() and ct.payload.cpu().numpy().tobytes() == ref, (t.shape, codec)
        assert copies == {"raw": 0, "many": 0}, copies  # written by the daemon, not copied in
        # A batch (the general ring path): frames into their buffers too, a non-contiguous tensor's included (its
        # input staged: the one copy).
        monkeypatch.undo()
        batch = [w, w.t(), ts[0]]
        refs = [x.payload.cpu().numpy().tobytes() for x in plain.compress(batch, codec="fast")]
        bufs = [torch.empty(tz.Client.frame_bound(x), dtype=torch.uint8, device="cuda") for x in batch[:2]] + [None]
        torch.cuda.synchronize()
        copies = count_copies(monkeypatch)
        cts = c.compress(batch, codec="fast", out=bufs)
        assert copies == {"raw": 0, "many": 1}, copies
        assert [x.payload.cpu().numpy().tobytes() for x in cts] == refs
        assert [x.payload.data_ptr() for x in cts[:2]] == [b.data_ptr() for b in bufs[:2]]
        assert all(same_bits(c.decompress(x), t) for x, t in zip(cts, batch))
        torch.cuda.synchronize()
        assert data_ops(ops) == [], ops
    finally:
        plain.close()


@needs_cuda
def test_a_lean_compress_done_again_still_fills_out(one_client, monkeypatch):
    """A lean request whose ring stopped or whose region went away (_AGAIN) is done again the general way; the frame
    still lands in out=, the ZeroMQ path's bytes."""
    c = one_client
    x = embedding().cuda()[:300]
    ref = c.compress(x, codec="fast").payload.cpu().numpy().tobytes()
    buf = torch.empty(tz.Client.frame_bound(x) + 64, dtype=torch.uint8, device="cuda")
    monkeypatch.setattr(c, "_one_submit", lambda *_a, **_k: _AGAIN)
    ct = c.compress(x, codec="fast", out=buf)
    assert ct.payload.data_ptr() == buf.data_ptr() and ct.payload.cpu().numpy().tobytes() == ref
    assert same_bits(c.decompress(ct), x)


@needs_cuda
def test_a_reused_out_is_written_after_the_callers_reads_of_it(one_client, monkeypatch):
    """One out buffer for every call, as a DDP bucket's: right after each compress() the caller's stream queues a
    copy of the frame (as a send would read it), held back by a GPU sleep, and the next compress() writes the buffer
    again, without host synchronisation in between. The daemon writes only after that copy: every copy decodes to its
    own tensor. (The lean path: the general one is refused.)"""
    c = one_client
    side = torch.cuda.Stream()
    base = embedding().cuda()[:512]
    buf = torch.empty(tz.Client.frame_bound(base), dtype=torch.uint8, device="cuda")
    n = int(os.environ.get("TZIP_RING_ORDER_ITERS", "10000")) // 20
    sent = []
    _general_path_refused(c, monkeypatch)
    with torch.cuda.stream(side):
        for i in range(n):
            torch.cuda._sleep(200_000)  # (GPU cycles: the input's kernel runs late)
            x = base + i  # a kernel writes the input right before the call
            ct = c.compress(x, codec="fast", out=buf)
            torch.cuda._sleep(200_000)  # the read of the frame runs late too
            sent.append((i, ct.payload.clone(), ct))  # read right after it, on the same stream
    torch.cuda.synchronize()
    bad = []
    for i, frame, ct in sent:
        back = c.decompress(tz.CompressedTensor(frame, ct.dtype, ct.shape, ct.codec, ct.nbytes))
        if not same_bits(back, base + i):
            bad.append(i)
    assert not bad, bad[:10]


@needs_cuda
def test_lean_calls_follow_the_callers_stream_both_ways(one_client):
    """A kernel writes the small input on a side stream right before compress(); another reads decompress()'s result
    on that stream right after it returns: no host synchronisation in between, every round trip bit-exact."""
    c = one_client
    base = embedding().cuda().reshape(-1)[:1000]  # 2000 bytes of bf16: the lean path
    bad = ordering_failures(torch.cuda.Stream(), base, int(os.environ.get("TZIP_RING_ORDER_ITERS", "10000")) // 5,
                            lambda x: c.decompress(c.compress(x, codec="fast")))
    assert not bad, bad[:10]


@needs_cuda
def test_lean_calls_keep_the_callers_memory_flat(one_client):
    c = one_client
    x = torch.ones(1, dtype=torch.bfloat16, device="cuda")
    for _ in range(50):
        c.decompress(c.compress(x))
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for _ in range(int(os.environ.get("TZIP_RING_MEMORY_ITERS", "10000"))):
        c.decompress(c.compress(x))
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() - before <= 1 << 20, (before, torch.cuda.memory_allocated())


@needs_cuda
def test_small_ring_batches_replayed_from_cuda_graphs_stay_exact(one_client):
    """The ring's batches of a few tensors are replayed from CUDA graphs kept per launch shape (cuda/src/gpu/graph.h):
    the same shape again and again with new values each time gives the frames of the ZeroMQ path (no graphs) and
    bit-exact round trips; a corrupt frame of a replayed shape is still rejected with its code, and the next good one
    still decodes."""
    c = one_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        for i in range(40):
            for dtype, shape in ((torch.bfloat16, (1,)), (torch.float32, (7, 33)), (torch.int8, (300,))):
                x = random_tensor(dtype, shape, seed=100 + i).cuda()
                ct = c.compress(x, codec="fast")
                ref = plain.compress(x, codec="fast")
                assert ct.payload.cpu().numpy().tobytes() == ref.payload.cpu().numpy().tobytes(), (i, dtype)
                assert same_bits(c.decompress(ct), x), (i, dtype)
        x = random_tensor(torch.float32, (7, 33), seed=7).cuda()
        ct = c.compress(x, codec="fast")
        for k in range(3):
            bad = ct.payload.clone()
            bad[-1 - k] ^= 0x5A  # a byte of the last chunk's coded data
            with pytest.raises(TzipDaemonError) as e:
                c.decompress(type(ct)(bad, ct.dtype, ct.shape, ct.codec, ct.nbytes))
            assert e.value.code in ("TZIP_CORRUPT", "TZIP_CHECKSUM", "TZIP_TRUNCATED"), e.value
            assert same_bits(c.decompress(ct), x)
        torch.cuda.synchronize()
    finally:
        plain.close()


@needs_cuda
def test_more_launch_shapes_than_graphs_kept_stay_exact(one_client):
    """Tensors of 1 to 20 chunks: 20 launch shapes each way, more than the 16 graphs a ring keeps, each call three
    times (run as usual, captured, replayed; or, past the limit, run as usual every time): every frame the ZeroMQ
    path's, every round trip bit-exact."""
    c = one_client
    plain = tz.connect(c.socket_path, spawn=False, strict=True, ring_entries=0)
    try:
        for k in range(1, 21):
            x = random_tensor(torch.bfloat16, (k * 32768,), seed=200 + k).cuda()  # k chunks of 64 KiB
            ref = plain.compress(x, codec="fast").payload.cpu().numpy().tobytes()
            for _ in range(3):
                ct = c.compress(x, codec="fast")
                assert ct.payload.cpu().numpy().tobytes() == ref, k
                assert same_bits(c.decompress(ct), x), k
        torch.cuda.synchronize()
    finally:
        plain.close()
