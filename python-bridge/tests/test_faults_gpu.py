"""GPU faults (issue 15, item 2): errors that reach the daemon's CUDA layer during a request, after which the client
gets an error and the daemon serves the next request bit-exact: frames damaged in GPU memory (the GPU decoder
finds them), a CUDA IPC handle whose exporting process has exited (CUDA cannot open it), a destination region too
small for the frame, and the daemon SIGKILLed while a GPU request is in flight (strict: an error; lenient: raw frames
on the GPU) and restarted.

Needs a CUDA GPU; without one every test is skipped with the reason. Run on a GPU host:
    .venv/bin/python -m pytest python-bridge/tests/test_faults_gpu.py -q -rs
"""

from __future__ import annotations

import random
import subprocess
import textwrap
import threading
import time
import warnings

import pytest
import torch

import tzip.client as tz
from tzip import _cuda
from tzip._dlpack import int_alias
from tzip.compressed import CompressedTensor

from test_client_support import PYTHON, DaemonProcess, RawConn, daemon, sock_dir, wait_for, daemon_stats as stats  # noqa: F401

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False): "
                                                  "GPU faults are tested on a GPU host")
DAMAGE_CODES = ("TZIP_CHECKSUM", "TZIP_CORRUPT", "TZIP_TRUNCATED", "TZIP_UNSUPPORTED")
#: A damaged header can also make the frame's declared size disagree with its region or destination.
FRAME_CODES = DAMAGE_CODES + ("TZIP_HANDLE", "TZIP_INVALID_ARGUMENT", "TZIP_TOO_LARGE")


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_alias(t.detach().contiguous()).cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def weights(n: int, seed: int, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("n", [100_000, 4 << 20], ids=["staged", "handed-over"])
def test_damaged_frames_in_gpu_memory(daemon, n):
    """One bit flipped at 40 places (fixed seed) of a frame on the GPU, and the frame cut at 8 lengths: every
    decompress to the GPU is an error (the decoder's checks and digests), never other data; the daemon decodes
    the intact frame bit-exact after each error."""
    c = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        t = weights(n, 1)
        ct = c.compress(t, codec="auto")
        assert ct.payload.device.type == "cuda" and same(c.decompress(ct), t)
        size = ct.payload.numel()
        rng = random.Random(21)
        positions = sorted(set(rng.sample(range(min(size, 4096)), 20)) | set(rng.sample(range(size), 20)))
        cases = [("flip", p, rng.randrange(8)) for p in positions] + [("cut", k, 0) for k in sorted(rng.sample(range(size), 8))]
        for k, (kind, pos, bit) in enumerate(cases):
            if kind == "flip":
                payload = ct.payload.clone()
                payload[pos] ^= 1 << bit
            else:
                payload = ct.payload[:pos].clone()
            bad = CompressedTensor(payload, ct.dtype, ct.shape, ct.codec, ct.nbytes)
            try:
                back = c.decompress(bad)
            except tz.TzipDaemonError as e:
                assert e.code in FRAME_CODES, (kind, pos, e.code, str(e))
            else:
                raise AssertionError(f"{kind} at {pos}: no error" + ("" if same(back, t) else ", and different data"))
            if k % 8 == 0:
                assert same(c.decompress(ct), t)
        assert same(c.decompress(ct), t) and daemon.alive()
        s = stats(daemon.socket)
        assert s["inflight"] == 0
    finally:
        c.close()


EXPORTER = textwrap.dedent("""
    import torch
    t = torch.ones(1 << 20, device="cuda")
    (_d, handle, size, offset, rc, rco, _e, _s) = t.untyped_storage()._share_cuda_()
    print(handle.hex(), offset, size, flush=True)
    # exits now: its CUDA context, and the memory behind the handle, go with it
""")


def test_a_handle_whose_exporter_exited_and_a_region_too_small(daemon):
    uuid = _cuda.device_uuid(0)
    # a real handle of memory freed since: its process exited before the request (run before hello: the exporter's
    # CUDA start-up can outlast the test daemon's short lease)
    out = subprocess.run([PYTHON, "-c", EXPORTER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    conn = RawConn(daemon.socket)
    try:
        assert conn.hello()["ok"]

        def ipc(handle: bytes, offset: int, size: int, rc: bytes | None = None) -> dict:
            h = {"kind": "cuda_ipc", "device_uuid": uuid, "device_index": 0, "handle": handle, "offset": offset, "size": size}
            if rc is not None:
                h.update(ref_counter_handle=rc, ref_counter_offset=0)
            return h

        f32 = {"code": 2, "bits": 32, "lanes": 1}
        handle, offset, size = out.stdout.split()
        mem = ipc(bytes.fromhex(handle), int(offset), int(size))
        r = conn.call("compress", tensors=[{"tensor": {"device": {"type": 2, "id": 0}, "dtype": f32, "shape": [1 << 18],
                                                       "byte_offset": 0, "data": mem},
                                            "out": {**mem, "offset": int(offset) + (2 << 20), "size": 2 << 20}}])
        assert r["ok"] is False and r["error"]["code"] == "TZIP_HANDLE", r
        assert conn.alive()

        # a destination region smaller than the frame's bytes, in this process's own memory
        x = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(22)) * 0.02)
        with tz.connect(daemon.socket, spawn=False, strict=True) as c:
            frame = c.compress(x).payload  # a CPU frame: the same bytes the GPU codec reads
        buf = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
        buf[: frame.numel()].copy_(frame.cuda())
        torch.cuda.synchronize()
        (_d, h, ssize, soff, rc, rco, _e, _s) = buf.untyped_storage()._share_cuda_()
        try:
            shared = ipc(bytes(h), int(soff), int(ssize), bytes(rc))
            nbytes = x.numel() * 4
            at = int(soff) + (2 << 20)

            def decompress(out_size: int) -> dict:
                return conn.call("decompress", verify=True, frames=[{
                    "frame": {**shared, "size": frame.numel()},
                    "out": {"device": {"type": 2, "id": 0}, "dtype": f32, "shape": [x.numel()], "byte_offset": 0,
                            "data": {**shared, "offset": at, "size": out_size}}}])

            assert conn.hello()["ok"]  # a new session: CUDA's start-up in this process can outlast the 2 s lease
            r = decompress(nbytes - 64)
            assert r["ok"] is False and r["error"]["code"] in ("TZIP_HANDLE", "TZIP_INVALID_ARGUMENT"), r
            r = decompress(nbytes)
            assert r["ok"] is True, r
            torch.cuda.synchronize()
            assert torch.equal(buf[2 << 20 : (2 << 20) + nbytes].cpu(), int_alias(x).view(torch.uint8))
        finally:
            torch.UntypedStorage._release_ipc_counter_cuda(bytes(rc), int(rco))
        assert conn.alive()
    finally:
        conn.close()
    with tz.connect(daemon.socket, spawn=False, strict=True) as c:
        y = weights(1 << 20, 23)
        assert same(c.decompress(c.compress(y)), y)
    assert daemon.alive()


def test_daemon_killed_during_gpu_requests_then_restarted(daemon):
    """The daemon SIGKILLed as soon as stats shows a GPU request in flight: the strict client gets
    DaemonUnavailableError, the lenient one raw frames on the GPU (bit-exact); after a restart both round-trip bit-exact
    through the daemon again."""
    lenient = tz.connect(daemon.socket, spawn=False, strict=False)
    strict = tz.connect(daemon.socket, spawn=False, strict=True)
    big = weights(64 << 20, 24)  # 128 MiB
    try:
        for c in (strict, lenient):
            box: dict = {}

            def kill() -> None:
                wait_for(lambda: stats(daemon.socket)["inflight"] >= 1, 60, 0.001)
                box["t"] = time.monotonic()
                daemon.kill()

            th = threading.Thread(target=kill, daemon=True)
            th.start()
            got = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                for _ in range(500):  # requests until the kill lands
                    try:
                        got = c.compress(big, codec="fast")
                    except tz.DaemonUnavailableError:
                        assert c is strict
                        got = "error"
                        break
                    if got.codec == "raw":
                        assert c is lenient
                        break
            th.join(30)
            assert got == "error" if c is strict else got.codec == "raw", got
            assert time.monotonic() - box["t"] < 10.0
            if c is lenient:
                assert got.payload.device.type == "cuda" and same(c.decompress(got), big)
            again = DaemonProcess(daemon.socket, "--lease-ms", "2000").start()
            daemon.proc = again.proc
            time.sleep(tz.RETRY_INTERVAL_S)
        for c in (strict, lenient):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ct = c.compress(big, codec="fast")
            assert ct.codec == "fast" and same(c.decompress(ct), big)
    finally:
        lenient.close()
        strict.close()
