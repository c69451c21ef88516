"""tzip.in_process.InProcessCodec: the codec in the caller's process. Its frames are the daemon's bytes (either decodes
the other's), every round trip is bit for bit (integer views), a bad frame is refused naming its index, ``out=`` works
as Client's does, and tzip.distributed with ``client=InProcessCodec()`` equals ``codec="raw"`` and plain PyTorch (two
gloo ranks, no daemon). The CUDA cases skip with the reason on a host without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_support import Pools, bits
from test_client_support import shared_daemon  # noqa: F401
from tzip import _native
from tzip._native import NativeCodecError

CUDA = torch.cuda.is_available() and _native.available() and _native.library().tzip_gpu_count() > 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch and libtzip.so: the GPU side of the "
                                                 "in-process codec is tested on a GPU host")
CODECS = ["fast", "max", "auto", "raw", "bytes"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def weights(dtype: torch.dtype, shape=(300, 37), seed: int = 3) -> torch.Tensor:
    """Weight-like values with -0.0, a subnormal, inf and a NaN with a payload among them (floats), small integers."""
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-3, 4, shape, generator=g).to(dtype) if dtype != torch.bool else \
            torch.randint(0, 2, shape, generator=g).bool()
    t = (torch.randn(shape, dtype=torch.float64, generator=g) * 0.02).to(dtype)
    if dtype.is_floating_point:
        flat = t.view(-1)
        flat[1], flat[2], flat[3] = -0.0, torch.finfo(dtype).smallest_normal / 4, float("inf")
        flat.view(bits(flat[:1]).dtype)[4] = {2: 0x7FC1, 4: 0x7FC0_0001, 8: 0x7FF8_0000_0000_0001}[dtype.itemsize]
    return t


@pytest.fixture(scope="module")
def codec():
    from tzip.in_process import InProcessCodec

    return InProcessCodec()


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool,
          torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_round_trip_and_the_daemons_bytes(codec, shared_daemon, dtype):  # noqa: F811
    import tzip

    c = tzip.Client(shared_daemon.socket, spawn=False, strict=True)
    try:
        x = weights(dtype)
        for name in CODECS:
            mine = codec.compress(x, name)
            theirs = c.compress(x, name)
            assert torch.equal(mine.payload, theirs.payload), (dtype, name)
            assert (mine.codec, mine.dtype, mine.shape, mine.nbytes) == (theirs.codec, theirs.dtype, theirs.shape, theirs.nbytes)
            assert same(codec.decompress(theirs), x) and same(c.decompress(mine), x), (dtype, name)
    finally:
        c.close()


def test_cpu_batches_empty_tensors_and_outs(codec):
    xs = [weights(torch.bfloat16), torch.empty(0, 5), weights(torch.float32, (7,)), torch.tensor(2.5)]
    cts = codec.compress(xs, "fast")
    assert [ct.shape for ct in cts] == [x.shape for x in xs]
    for x, y in zip(xs, codec.decompress(cts)):
        assert same(x, y)
    strided = torch.empty(37, 300, dtype=torch.bfloat16).t()
    dense = torch.empty(7)
    got = codec.decompress(cts[::2], out=[strided, dense])
    assert got[0] is strided and got[1] is dense and same(strided, xs[0]) and same(dense, xs[2])
    buf = torch.empty(65536, dtype=torch.uint8)
    ct = codec.compress(xs[0], "fast", out=buf)
    assert ct.payload.data_ptr() == buf.data_ptr() and same(codec.decompress(ct), xs[0])


def test_a_bad_frame_is_refused_naming_its_index(codec):
    good = codec.compress(weights(torch.float32, (20000,)), "fast")
    bad = codec.compress(weights(torch.float32, (20000,), seed=4), "fast")
    bad.payload = bad.payload.clone()
    bad.payload[bad.payload.numel() // 2] ^= 0x5A
    with pytest.raises(NativeCodecError) as e:
        codec.decompress([good, bad])
    assert e.value.index == 1 and e.value.code in ("TZIP_CORRUPT", "TZIP_CHECKSUM")
    short = codec.compress(weights(torch.float32, (2000,)), "fast")
    short.payload = short.payload[:-9]
    with pytest.raises(NativeCodecError) as e:
        codec.decompress(short)
    assert e.value.code in ("TZIP_TRUNCATED", "TZIP_CORRUPT")
    with pytest.raises(ValueError, match="out is"):
        codec.decompress(good, out=torch.empty(20001))
    with pytest.raises(ValueError, match="unknown codec"):
        codec.compress(torch.ones(3), "zip")
    from tzip.in_process import InProcessCodec

    for bad in (-1, 1025, True, 2.0):
        with pytest.raises(ValueError, match="sm_budget"):
            InProcessCodec(sm_budget=bad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32], ids=str)
def test_cuda_frames_are_the_cpu_codecs_bytes(codec, dtype):
    x = weights(dtype, (1000, 257))
    for name in ("fast", "auto", "raw"):
        g = codec.compress(x.cuda(), name)
        h = codec.compress(x, name)
        assert g.payload.is_cuda and torch.equal(g.payload.cpu(), h.payload), (dtype, name)
        assert g.codec == h.codec
        assert same(codec.decompress(g), x) and same(codec.decompress(h, out=torch.empty_like(x, device="cuda")), x)
        strided = torch.empty(257, 1000, dtype=dtype, device="cuda").t()
        assert same(codec.decompress(g, out=strided), x)
        from tzip.client import Client

        buf = torch.empty(Client.frame_bound(x), dtype=torch.uint8, device="cuda")
        inplace = codec.compress(x.cuda(), name, out=buf)
        assert inplace.payload.data_ptr() == buf.data_ptr() and torch.equal(inplace.payload, g.payload)


@needs_cuda
def test_cuda_a_bad_frame_is_refused_naming_its_index(codec):
    good = codec.compress(weights(torch.bfloat16, (50000,)).cuda(), "fast")
    bad = codec.compress(weights(torch.bfloat16, (50000,), seed=9).cuda(), "fast")
    bad.payload = bad.payload.clone()
    bad.payload[bad.payload.numel() // 2] ^= 0x5A
    with pytest.raises(NativeCodecError) as e:
        codec.decompress([good, bad])
    assert e.value.index == 1


# --- tzip.distributed with the in-process codec (no daemon: the workers have no TZIP_SOCKET) --------------------------


def w_all_reduce(rank, world, device: str):
    import tzip.distributed as tzd
    from tzip.in_process import InProcessCodec

    if device == "cuda":
        torch.cuda.set_device(0)
    codec = InProcessCodec()
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        for shape in [(), (0,), (37, 11), (70001,)]:
            x = (weights(dtype, shape, seed=rank) if len(shape) > 1 or shape == (70001,) else
                 torch.full(shape, float(rank + 1), dtype=dtype)).to(device)
            x[torch.isnan(x) | torch.isinf(x)] = 0.5  # (which NaN a sum keeps is the arithmetic's choice)
            plain = x.clone()
            dist.all_reduce(plain)
            raw = x.clone()
            tzd.all_reduce(raw, codec="raw")
            for piece_bytes in (0, 4096):
                t = x.clone()
                tzd.all_reduce(t, codec="fast", client=codec, piece_bytes=piece_bytes)
                assert same(t, raw) and same(t, plain), (str(dtype), shape, piece_bytes)
                checked += 1
    return checked


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    # no daemon to be found nor started: a request that reached for one would fail the test
    d = tmp_path_factory.mktemp("away")
    p = Pools({"TZIP_SOCKET": str(d / "none" / "tzip.sock"), "TZIP_CLI": str(d / "no-cli.js")})
    yield p
    p.close()


def test_all_reduce_with_the_in_process_codec_equals_raw_and_plain(pools):
    assert pools(2).run(w_all_reduce, timeout=300, device="cpu")[0] == 16


@needs_cuda
def test_cuda_all_reduce_with_the_in_process_codec_equals_raw_and_plain(pools):
    assert pools(2).run(w_all_reduce, timeout=300, device="cuda")[0] == 16
