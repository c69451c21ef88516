"""Round trips through a real daemon (one `tzip serve` process for the module): every dtype bit-exact
(compared as integer views / bytes, never as floats), -0.0 and NaN payloads, views with storage offsets,
non-contiguous tensors, batches, async calls, shared-memory (zero-copy) tensors, serialisation.
"""

from __future__ import annotations

import errno
import gc
import io
import math
import os
import secrets
import warnings

import pytest
import torch

import tzip.client as tz
from tzip import _shm
from tzip._dlpack import frame_layout_of, int_alias
from tzip._frame import encode_raw, max_compressed_size, read_header
from tzip.compressed import CompressedTensor

from test_client_support import ALL_DTYPES, shared_daemon  # noqa: F401  (fixture)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality through integer views (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(int_alias(a.contiguous()), int_alias(b.contiguous()))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern: NaNs with payloads, denormals, ...)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    """-0.0, +-inf, NaNs with payloads and sign, denormals, extremes of a float dtype, as exact bit patterns."""
    if dtype == torch.float32:
        bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001,
                0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F800000]
        return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    if dtype == torch.float64:
        bits = [0, 1 << 63, 0x7FF0000000000000, 0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 0x0000000000000001]
        return torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in bits], dtype=torch.int64).view(torch.float64)
    bits16 = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFFFF, 0x7F80, 0xFF81, 0x0001, 0x8001, 0x7BFF, 0x3C00]
    return torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in bits16], dtype=torch.int16).view(dtype)


@pytest.fixture(scope="module")
def client(shared_daemon):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the daemon is there
        c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    yield c
    c.close()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(client, dtype):
    for shape in [(0,), (1,), (7, 13), (3, 1, 70001 // 3 + 1)]:
        t = random_tensor(dtype, shape, seed=hash((str(dtype), shape)) & 0xFFFF)
        ct = client.compress(t)
        assert isinstance(ct, CompressedTensor)
        assert ct.dtype == dtype and tuple(ct.shape) == shape and ct.nbytes == t.numel() * dtype.itemsize
        assert ct.codec in ("raw", "fast", "max", "bytes")
        assert read_header(ct.payload).frame_bytes == ct.payload.numel()
        back = client.decompress(ct)
        assert same_bits(back, t), (dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_special_float_values_survive(client, dtype):
    t = special_floats(dtype).repeat(1000)
    for codec in tz.CODECS:
        back = client.decompress(client.compress(t, codec=codec))
        assert same_bits(back, t), codec
        # -0.0 stays negative, NaN payload bits stay
        assert torch.signbit(back[1]) and back[1] == 0


def test_codecs_and_ratio_on_weights(client):
    w = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)
    for codec in tz.CODECS:
        ct = client.compress(w, codec=codec)
        assert ct.codec == codec if codec != "auto" else ct.codec in ("fast", "max", "bytes", "raw")
        assert same_bits(client.decompress(ct), w)
    assert client.compress(w, codec="max").ratio < 0.8  # bf16 weights compress
    with pytest.raises(ValueError):
        client.compress(w, codec="zip")


@pytest.mark.parametrize("ring_entries", [0, None], ids=["zeromq", "ring"])
def test_a_cpu_tensor_without_a_codec_is_coded_auto(shared_daemon, ring_entries):
    """codec=None (the default; tzip._codec_choice): a CPU tensor gets `auto`, the same frame byte for byte, through
    the ring and through ZeroMQ, blocking and async; the job's codec setting still wins (tzip set JOB codec=fast)."""
    kw = {} if ring_entries is None else {"ring_entries": ring_entries}
    job = f"codec-default-{ring_entries}"  # a job of its own: its setting must not reach the other case
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True, job=job, **kw)
    try:
        w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
        auto = c.compress(w, codec="auto")
        assert auto.codec == "max"  # the default differs from fast here, so the test tells them apart
        for got in (c.compress(w), c.compress([w])[0], c.compress_async(w).result(timeout=30)):
            assert got.codec == auto.codec
            assert got.payload.numpy().tobytes() == auto.payload.numpy().tobytes()
        operator = tz.connect(shared_daemon.socket, spawn=False, strict=True)
        try:
            operator._session.call("set", {"job": job, "codec": "fast"})
        finally:
            operator.close()
        # no heartbeat in between: the daemon applies the setting to the very next request, ZeroMQ or ring SQE
        assert c.compress(w).codec == "fast"
    finally:
        c.close()


def test_unknown_codecs_are_refused_before_any_request(client):
    w = torch.ones(8, dtype=torch.bfloat16)
    for bad in ("zip", "", "AUTO", 1):
        with pytest.raises(ValueError, match="unknown codec"):
            client.compress(w, codec=bad)
        with pytest.raises(ValueError, match="unknown codec"):
            client.compress_async(w, codec=bad).result(timeout=10)


def test_raw_codec_equals_the_python_fallback_frame(client):
    t = random_tensor(torch.bfloat16, (300, 301), seed=5)
    ct = client.compress(t, codec="raw")
    fdtype, fshape = frame_layout_of(t.dtype, t.shape)
    local = encode_raw(t.contiguous().view(-1).view(torch.uint8), fdtype, fshape)
    assert torch.equal(ct.payload, local)


@pytest.mark.parametrize("codec", ["raw", "max"])  # raw: decoded in this process, max: by the daemon
def test_a_corrupt_frame_is_a_tzip_error_with_the_daemons_code_whoever_decodes_it(client, codec):
    t = random_tensor(torch.bfloat16, (300, 301), seed=6)
    ct = client.compress(t, codec=codec)
    bad = ct.payload.clone()
    bad[-7] ^= 0x10  # a byte of the last chunk's coded data: its digest no longer matches
    short = ct.payload[:-1].clone()
    for payload, code in ((bad, "TZIP_CHECKSUM"), (short, "TZIP_TRUNCATED")):
        with pytest.raises(tz.TzipDaemonError) as e:
            client.decompress(CompressedTensor(payload, ct.dtype, ct.shape, ct.codec, ct.nbytes))
        assert e.value.code == code, (codec, e.value)
    out = torch.zeros_like(t)
    with pytest.raises(tz.TzipDaemonError):
        client.decompress(CompressedTensor(bad, ct.dtype, ct.shape, ct.codec, ct.nbytes), out=out)


def test_views_with_storage_offsets_and_strides(client):
    base = random_tensor(torch.float32, (64, 96), seed=1)
    views = {
        "row slice (offset)": base[5:17],
        "column slice (strided)": base[:, 3:50],
        "transpose": base.t(),
        "step": base[::3, ::2],
        "element": base[7, 9],
        "expanded (stride 0)": base[0:1].expand(10, 96),
        "flat offset": base.view(-1)[1234:5678],
        "narrow bf16": base.to(torch.bfloat16)[3:, 1:-1],
        "33 dims": torch.arange(2 * 3, dtype=torch.int32).reshape(*([1] * 31), 2, 3),
        "complex strided": torch.complex(base, -base)[::2, 1::3],
    }
    cts = client.compress(list(views.values()))
    backs = client.decompress(cts)
    for (name, v), ct, back in zip(views.items(), cts, backs):
        assert tuple(ct.shape) == tuple(v.shape), name
        assert back.is_contiguous(), name
        assert same_bits(back, v), name


def test_batch_of_200_parameters_and_async(client):
    params = [random_tensor(torch.bfloat16, (i % 7 + 1, 37 + i), seed=i) for i in range(200)]
    cts = client.compress(params)
    assert len(cts) == 200
    backs = client.decompress(cts)
    assert all(same_bits(a, b) for a, b in zip(params, backs))
    futs = [client.compress_async(p) for p in params[:20]] + [client.compress_async(params[20:40])]
    done = [f.result(timeout=60) for f in futs]
    assert all(same_bits(client.decompress(ct), p) for ct, p in zip(done[:20], params[:20]))
    back_f = client.decompress_async(done[20])
    assert all(same_bits(a, b) for a, b in zip(back_f.result(timeout=60), params[20:40]))


def test_decompress_into_out(client):
    t = random_tensor(torch.float16, (33, 65), seed=3)
    ct = client.compress(t)
    out = torch.empty(33, 65, dtype=torch.float16)
    assert client.decompress(ct, out=out) is out and same_bits(out, t)
    strided_out = torch.empty(65, 33, dtype=torch.float16).t()
    assert same_bits(client.decompress(ct, out=strided_out), t)
    shm_out = client.empty((33, 65), torch.float16)
    assert client.decompress(ct, out=shm_out) is shm_out and same_bits(shm_out, t)
    with pytest.raises(ValueError):
        client.decompress(ct, out=torch.empty(33, 64, dtype=torch.float16))
    # A CompressedTensor made by hand whose byte count is not its shape's: refused before the daemon could write that
    # many bytes into out's memory (its neighbours in the allocation untouched).
    big = torch.zeros(2, 33, 65, dtype=torch.float16)
    liar = tz.CompressedTensor(ct.payload, ct.dtype, (32, 65), ct.codec, ct.nbytes)
    with pytest.raises(ValueError, match="says 4290 bytes"):
        client.decompress(liar, out=big[0, :32])
    assert not big.any()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "zeromq"])
def test_compress_into_out(client, shared_daemon, ring):
    """compress(out=) puts each frame at the start of its buffer (the payload a view of it), the same bytes as without
    out=, nothing written past the buffer; batches take a buffer or None per tensor; every kind of bad buffer is
    refused before anything is written."""
    c = client if ring else tz.connect(shared_daemon.socket, spawn=False, strict=True, ring_entries=0)
    try:
        t = random_tensor(torch.bfloat16, (300, 200), seed=11)
        u = random_tensor(torch.float32, (5, 7, 9), seed=12)
        bound = tz.Client.frame_bound(t)
        assert bound == max_compressed_size(t.nbytes, 2) and tz.Client.frame_bound(u) == max_compressed_size(u.nbytes, 3)
        for codec in ("max", "fast", "raw"):
            ref = c.compress(t, codec=codec).payload.numpy().tobytes()
            arena = torch.full((bound + 64,), 0xAB, dtype=torch.uint8)
            ct = c.compress(t, codec=codec, out=arena[:bound])
            assert ct.payload.data_ptr() == arena.data_ptr() and ct.payload.numpy().tobytes() == ref, codec
            assert (arena[bound:] == 0xAB).all(), codec  # nothing past out
            assert same_bits(c.decompress(ct), t)
        bufs = [torch.empty(tz.Client.frame_bound(t) + 100, dtype=torch.uint8), None,
                torch.empty(tz.Client.frame_bound(u), dtype=torch.uint8)]
        cts = c.compress([t, t[:10], u], out=bufs)
        assert cts[0].payload.data_ptr() == bufs[0].data_ptr() and cts[2].payload.data_ptr() == bufs[2].data_ptr()
        assert all(same_bits(c.decompress(ct), x) for ct, x in zip(cts, (t, t[:10], u)))
        empty = torch.empty(0, 3, dtype=torch.float16)
        ct = c.compress(empty, out=torch.empty(tz.Client.frame_bound(empty), dtype=torch.uint8))
        assert same_bits(c.decompress(ct), empty)

        before = t.clone()
        joint = torch.zeros(t.nbytes + bound, dtype=torch.uint8)
        inside = joint[: t.nbytes].view(torch.bfloat16).view(300, 200)
        inside.copy_(t)
        bad = [(torch.empty(bound - 1, dtype=torch.uint8), ValueError, "needs up to"),
               (torch.empty(bound, dtype=torch.int8), ValueError, "uint8"),
               (torch.empty(2, bound, dtype=torch.uint8), ValueError, "1-D"),
               (torch.empty(2 * bound, dtype=torch.uint8)[::2], ValueError, "contiguous"),
               (b"\0" * bound, TypeError, "uint8 tensors")]
        for o, err, msg in bad:
            with pytest.raises(err, match=msg):
                c.compress(t, out=o)
        with pytest.raises(ValueError, match="shares memory"):
            c.compress(inside, out=joint[t.nbytes // 2 :])  # over the input's bytes
        with pytest.raises(ValueError, match="shares memory"):
            c.compress(inside[::2], out=joint[2 : 2 + bound])  # between a strided input's elements
        two = torch.zeros(2 * bound, dtype=torch.uint8)
        with pytest.raises(ValueError, match="shares memory"):
            c.compress([t, t], out=[two[:bound + 1], two[bound:]])  # over each other
        assert not two.any() and same_bits(inside, before) and same_bits(t, before)
        with pytest.raises(TypeError, match="a list"):
            c.compress([t, u], out=torch.empty(2 * bound, dtype=torch.uint8))
        with pytest.raises(ValueError, match="2 entries for 3"):
            c.compress([t, u, t], out=[None, None])
    finally:
        if c is not client:
            c.close()


def test_compress_into_out_when_the_ring_gives_up(client, monkeypatch):
    """A ring request that fails as a released region does (TZIP_HANDLE) is done again through ZeroMQ: its frames
    still land in their out= buffers."""
    from tzip._ring_path import RingPath

    calls = []

    def refused(*_a, **_k):
        calls.append(1)
        raise tz.TzipDaemonError("TZIP_HANDLE", "region 1 was released")

    t = random_tensor(torch.bfloat16, (70, 30), seed=21)
    u = random_tensor(torch.int32, (9,), seed=22)
    ref = [x.payload.numpy().tobytes() for x in client.compress([t, u], codec="fast")]
    monkeypatch.setattr(RingPath, "_compress_start_cpu", refused)
    bufs = [torch.empty(tz.Client.frame_bound(x), dtype=torch.uint8) for x in (t, u)]
    cts = client.compress([t, u], codec="fast", out=bufs)
    assert [x.payload.data_ptr() for x in cts] == [b.data_ptr() for b in bufs]
    assert [x.payload.numpy().tobytes() for x in cts] == ref and calls == [1]


def test_conjugate_and_negative_views_round_trip_as_their_values(client):
    """PyTorch's lazy conj()/neg views keep the original bytes and a bit that flips a sign on reading: compress takes
    their values (also from shared memory, where the daemon would read bytes in place), and decompress refuses such a
    view as out= (it would write bytes that read back negated)."""
    z = random_tensor(torch.complex64, (6, 5), seed=31)
    in_shm = client.empty((6, 5), torch.complex64)
    in_shm.copy_(z)
    neg = torch._neg_view(random_tensor(torch.float32, (7,), seed=32))
    for x in (z.conj(), in_shm.conj(), z.conj().imag, neg):
        assert x.is_conj() or x.is_neg()
        want = x.resolve_conj().resolve_neg()
        for ct in (client.compress(x), client.compress_async([x]).result()[0],
                   client.compress(x, out=torch.empty(tz.Client.frame_bound(x), dtype=torch.uint8))):
            assert same_bits(client.decompress(ct), want)
    ct = client.compress(z)
    with pytest.raises(ValueError, match="conjugate or negative view"):
        client.decompress(ct, out=torch.empty_like(z).conj())


def test_bad_inputs_with_out_raise_the_inputs_errors(client):
    """With out= given, an input that is not a tensor, or one tzip cannot take, raises its own TypeError first."""
    t = random_tensor(torch.float32, (10,), seed=1)
    buf = torch.empty(tz.Client.frame_bound(t), dtype=torch.uint8)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        client.compress([t, 3], out=[buf, None])
    with pytest.raises(TypeError, match="strided"):
        client.compress(t.to_sparse(), out=buf)
    with pytest.raises(TypeError, match="meta tensors"):
        client.compress(torch.empty(10, device="meta"), out=torch.empty(200, dtype=torch.uint8, device="meta"))
    with torch.inference_mode():
        made_there = torch.empty(tz.Client.frame_bound(t), dtype=torch.uint8)
    with pytest.raises(ValueError, match="inference mode"):
        client.compress(t, out=made_there)


def test_compress_into_out_without_a_daemon(tmp_path):
    """strict=False and no daemon: the raw frame of the fallback goes into out= as any frame does."""
    c = tz.connect(str(tmp_path / "none" / "tzip.sock"), spawn=False, strict=False)
    try:
        t = random_tensor(torch.float16, (40, 9), seed=2)
        buf = torch.zeros(tz.Client.frame_bound(t) + 8, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the fallback's warning: once per process)
            ct = c.compress(t, out=buf)
        assert ct.codec == "raw" and ct.payload.data_ptr() == buf.data_ptr()
        assert same_bits(c.decompress(ct), t)
    finally:
        c.close()


@pytest.mark.parametrize("codec", ["max", "raw"])  # raw: decoded in this process, max: by the daemon
def test_destinations_that_share_memory_are_refused(client, codec):
    """An out whose elements share memory (expand), two outs over the same bytes, an out over a frame of the call:
    ValueError before anything is written (PyTorch's out= refuses them too); outs that only touch, and views of one
    storage that lie apart, are decoded bit-exact."""
    t = random_tensor(torch.bfloat16, (300, 200), seed=7)
    u = random_tensor(torch.bfloat16, (300, 200), seed=8)
    ct, cu = client.compress([t, u], codec=codec)
    n = t.numel()
    with pytest.raises(ValueError, match="share memory"):
        client.decompress(ct, out=torch.empty(1, 200, dtype=torch.bfloat16).expand(300, 200))
    with pytest.raises(ValueError, match="share memory"):
        client.decompress(ct, out=torch.empty(n, dtype=torch.bfloat16).as_strided((300, 200), (100, 1)))
    base = torch.zeros(2 * n, dtype=torch.bfloat16)
    before = base.clone()
    for outs in ([base[:n].view(300, 200), base[n // 2 : n // 2 + n].view(300, 200)],   # overlapping halves
                 [base[:n].view(300, 200), base[:n].view(300, 200)]):                   # the same bytes twice
        with pytest.raises(ValueError, match="shares memory"):
            client.decompress([ct, cu], out=outs)
        assert torch.equal(base.view(torch.int16), before.view(torch.int16))  # nothing written
    frame_bytes = ct.payload.numel()
    over_frame = ct.payload[: (frame_bytes // 2) * 2].view(torch.bfloat16)[: n].reshape(-1) if frame_bytes >= 2 * n else None
    if over_frame is not None:
        with pytest.raises(ValueError, match="shares memory"):
            client.decompress(ct, out=over_frame.view(300, 200))
    r = client.decompress([ct, cu], out=[base[:n].view(300, 200), base[n:].view(300, 200)])  # apart, touching
    assert same_bits(r[0], t) and same_bits(r[1], u)
    cols = torch.empty(200, 600, dtype=torch.bfloat16)
    r = client.decompress([ct, cu], out=[cols[:, :300].t(), cols[:, 300:].t()])  # interleaved columns, disjoint
    assert same_bits(r[0], t) and same_bits(r[1], u)


def test_shared_memory_tensors_go_zero_copy(client, monkeypatch):
    t = client.empty((256, 1024), torch.bfloat16)
    t.copy_(random_tensor(torch.bfloat16, (256, 1024), seed=9))
    assert _shm.find(t.data_ptr(), t.numel() * 2) is not None
    view = t[10:20]  # a view with a storage offset inside the segment
    copies = []
    real_copy = tz.copy_into_bytes
    monkeypatch.setattr(tz, "copy_into_bytes", lambda dst, src: (copies.append(src.shape), real_copy(dst, src)))
    cts = client.compress([t, view])
    assert copies == []  # no staging copy: the daemon read the tensors where they are
    client.compress(t.t())  # not contiguous: staged
    assert len(copies) == 1
    monkeypatch.undo()
    assert all(same_bits(client.decompress(c), x) for c, x in zip(cts, [t, view]))
    # decompressed tensors of >= 1 MiB come back in shared memory, ready for zero-copy again
    big = random_tensor(torch.float32, (512, 1024), seed=2)
    back = client.decompress(client.compress(big))
    assert _shm.find(back.data_ptr(), back.numel() * 4) is not None and same_bits(back, big)


def test_result_memory_is_reused_only_once_every_tensor_over_it_died(client):
    a = random_tensor(torch.bfloat16, (1000, 1037), seed=21)  # 2,074,000 bytes: a size no other test decompresses
    b = random_tensor(torch.bfloat16, (1000, 1037), seed=22)
    ca, cb = client.compress([a, b])
    first = client.decompress(ca)
    ptr = first.data_ptr()
    view = first[100:200]  # a view keeps the memory lent
    del first
    gc.collect()
    second = client.decompress(cb)
    assert second.data_ptr() != ptr
    assert same_bits(view, a[100:200]) and same_bits(second, b)
    del view
    gc.collect()
    third = client.decompress(ca)  # now the first result's memory is free again: written there
    assert third.data_ptr() == ptr
    assert same_bits(third, a) and same_bits(second, b)


def test_results_lent_before_a_fork_are_never_reused(client):
    """A forked child (a DataLoader or multiprocessing worker) shares the pages of the parent's results (MAP_SHARED):
    the parent must not write a later result there when its own tensor dies."""
    a = random_tensor(torch.bfloat16, (1000, 1039), seed=31)  # a size no other test decompresses
    b = random_tensor(torch.bfloat16, (1000, 1039), seed=32)
    ca, cb = client.compress([a, b])
    t = client.decompress(ca)
    seg_a = _shm.find(t.data_ptr(), 1)[0]
    want = a.view(torch.uint8).numpy().tobytes()  # the child compares with numpy only (torch's threads after fork)
    go_r, go_w = os.pipe()
    ans_r, ans_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child keeps its copy of t (and exits when the parent goes away: EOF on go_r)
        try:
            os.close(go_w)
            os.close(ans_r)
            if os.read(go_r, 1) == b"x":
                os.write(ans_w, b"1" if t.view(torch.uint8).numpy().tobytes() == want else b"0")
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(ans_w)
    try:
        del t
        gc.collect()
        again = client.decompress(cb)
        reused = _shm.find(again.data_ptr(), 1)[0] == seg_a
        os.write(go_w, b"x")
        child_saw_a = os.read(ans_r, 1) == b"1"
    finally:
        os.close(go_w)
        os.close(ans_r)
        os.waitpid(pid, 0)
    assert not reused and child_saw_a
    assert same_bits(again, b)


def test_a_full_dev_shm_frees_idle_segments_and_retries(shared_daemon, monkeypatch):
    real = os.posix_fallocate
    calls = []

    def full_once(fd, offset, length):
        calls.append(length)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    with tz.connect(shared_daemon.socket, spawn=False, strict=True) as fresh:
        t = random_tensor(torch.bfloat16, (1024, 1024), seed=6)
        ct = fresh.compress(t)
        back = fresh.decompress(ct)
        del back
        gc.collect()
        fresh._results.trim()
        assert fresh._arena.idle_bytes > 0 and fresh._results.idle_bytes > 0
        monkeypatch.setattr(os, "posix_fallocate", full_once)
        big = random_tensor(torch.bfloat16, (3000, 1024), seed=7)  # needs new segments
        assert same_bits(fresh.decompress(fresh.compress(big)), big)
        assert len(calls) >= 2  # refused once, then made after the idle segments were freed
        assert fresh._results.idle_bytes == 0


def test_result_pool_keeps_discards_and_trims():
    dropped: list[str] = []
    prefix = f"tzip-{os.getpid()}-{secrets.token_hex(8)}-"
    arena = _shm.Arena(prefix, dropped.append)
    pool = _shm.ResultPool(arena, keep_bytes=3 << 20, keep_s=60.0)
    s1, t1 = pool.lend(1 << 20)
    s2, t2 = pool.lend(1 << 20)
    assert t1.numel() == 1 << 20 and t1.data_ptr() == s1.base and s1 is not s2
    pool.discard(s2)  # as after a request that got no answer
    del t1, t2
    gc.collect()
    pool.trim()
    assert dropped == [s2.name] and not os.path.exists(os.path.join(_shm.SHM_DIR, s2.name))
    assert pool.idle_bytes == s1.size
    s3, t3 = pool.lend((1 << 20) - 5000)  # within 1/8 + a page of the idle segment: reused
    assert s3 is s1 and t3.numel() == (1 << 20) - 5000
    s4, t4 = pool.lend(100_000)  # far smaller than any idle segment: a new one
    assert s4 is not s1
    s5, t5 = pool.lend(3 << 20)
    del t3, t4, t5
    gc.collect()
    pool.trim()  # 1 MiB + 100 KB + 3 MiB idle, 3 MiB kept: the largest goes
    assert dropped == [s2.name, s5.name] and pool.idle_bytes == s1.size + s4.size
    _, t6 = pool.lend(1 << 20)
    pool.close()  # idle ones closed now, the lent one when its tensor dies
    assert sorted(dropped) == sorted([s2.name, s5.name, s4.name])
    del t6
    gc.collect()
    assert sorted(dropped) == sorted([s2.name, s5.name, s4.name, s1.name])
    assert not any(n.startswith(prefix) for n in os.listdir(_shm.SHM_DIR))


def test_a_full_dev_shm_is_a_clear_error_not_a_crash(shared_daemon, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with tz.connect(shared_daemon.socket, spawn=False, strict=True) as fresh:  # an empty arena
        monkeypatch.setattr(os, "posix_fallocate", full)
        t = random_tensor(torch.bfloat16, (1024, 1024), seed=5)
        with pytest.raises(OSError, match="no room in /dev/shm .*--shm-size") as e:
            fresh.compress(t)
        assert e.value.errno == errno.ENOSPC
        monkeypatch.undo()
        assert not [n for n in os.listdir(_shm.SHM_DIR) if n.startswith(fresh.shm_prefix)]
        assert same_bits(fresh.decompress(fresh.compress(t)), t)  # and the client goes on


def test_torch_file_system_shared_tensors_go_zero_copy(client):
    import torch.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        t = random_tensor(torch.float32, (100, 100), seed=4).share_memory_()
        handle = _shm.torch_shm_handle(t[3:])
        assert handle is not None and handle[0].startswith(f"torch_")
        for x in (t, t[3:], t[50]):
            assert same_bits(client.decompress(client.compress(x)), x)
    finally:
        mp.set_sharing_strategy(old)


def test_compressed_tensor_bytes_and_torch_save(client):
    t = random_tensor(torch.complex64, (17, 5), seed=8)
    ct = client.compress(t)
    again = CompressedTensor.from_bytes(ct.to_bytes())
    assert torch.equal(again.payload, ct.payload) and again.dtype == ct.dtype and again.shape == ct.shape
    assert same_bits(client.decompress(again), t)
    buf = io.BytesIO()
    torch.save({"ct": ct, "list": [ct, ct]}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert same_bits(client.decompress(loaded["ct"]), t)
    bad = bytearray(ct.to_bytes())
    bad[-1] ^= 0xFF  # payload byte: detected at decompression (digest)
    with pytest.raises(tz.TzipDaemonError) as e:
        client.decompress(CompressedTensor.from_bytes(bytes(bad)))
    assert e.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT")
    with pytest.raises(ValueError):
        CompressedTensor.from_bytes(b"TZCT" + bytes(20))
    with pytest.raises(ValueError, match="CPU or a CUDA GPU"):
        CompressedTensor.from_bytes(ct.to_bytes(), device="meta")
    meta_lie = CompressedTensor(ct.payload, torch.float64, ct.shape, ct.codec, ct.nbytes)
    with pytest.raises(ValueError):
        CompressedTensor.from_bytes(meta_lie.to_bytes())
    # The same lie handed to decompress (the ring's default path decodes by byte count only) and pickled: refused by
    # the frame header's check, never decoded as float64 (an adversarial pass found both reinterpreted silently).
    with pytest.raises(ValueError, match="does not match the metadata"):
        client.decompress(meta_lie)
    with pytest.raises(ValueError, match="does not match the metadata"):
        client.decompress(CompressedTensor(ct.payload, ct.dtype, (5, 17), ct.codec, ct.nbytes))
    buf = io.BytesIO()
    torch.save({"ct": meta_lie}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="does not match the metadata"):
        torch.load(buf, weights_only=True)
    import msgpack
    meta = msgpack.packb({"dtype": 5, "shape": [17, 5], "codec": ct.codec, "nbytes": ct.nbytes})
    with pytest.raises(ValueError, match="is not a name"):
        CompressedTensor.from_bytes(b"TZCT\x01\0\0\0" + len(meta).to_bytes(4, "little") + meta + ct.payload.numpy().tobytes())
    with pytest.raises(ValueError, match="truncated CompressedTensor bytes"):
        CompressedTensor.from_bytes(ct.to_bytes()[:-10])
    with pytest.raises(ValueError, match="bytes follow the"):
        CompressedTensor.from_bytes(ct.to_bytes() + b"\0")
    with pytest.raises(TypeError, match="from_bytes"):
        client.decompress(ct.to_bytes())
    with pytest.raises(TypeError, match="out= of a batch is a list"):
        client.decompress([ct], out=torch.empty(17, 5, dtype=torch.complex64))


def test_refuses_what_it_cannot_take(client):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError):
        client.compress(q)
    with pytest.raises(TypeError):
        client.compress(torch.randn(4, 4).to_sparse())
    with pytest.raises(TypeError):
        client.compress(torch.empty(3, device="meta"))


def test_stats_count_this_session(client):
    s = client.stats()
    assert s["sessions"] >= 1 and s["session"]["pid"] > 0
    assert s["compress"]["items"] > 0 and s["decompress"]["items"] > 0
    assert client.ping() < 1.0


def test_parameters_that_require_grad(client):
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    model(torch.randn(8, 32, dtype=torch.bfloat16)).sum().backward()
    params = list(model.parameters())
    cts = client.compress(model.parameters())
    grads = client.compress([p.grad for p in params])
    assert all(not ct.payload.requires_grad for ct in cts)
    for p, ct, g in zip(params, client.decompress(cts), client.decompress(grads)):
        assert not ct.requires_grad
        assert same_bits(ct, p.detach()) and same_bits(g, p.grad)
    out = torch.nn.Parameter(torch.empty_like(params[0]))
    client.decompress(cts[0], out=out)
    assert same_bits(out.detach(), params[0].detach())
