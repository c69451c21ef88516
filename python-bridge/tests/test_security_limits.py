"""Per-session limits seen from Python (docs/security.md, "Limits"): a daemon with small limits answers a client
over one with TZIP_LIMIT (tzip.TzipDaemonError, the message naming the limit, its value and the `tzip serve` flag),
serves that client on within the limit and other clients unaffected, bit-exact. The CUDA IPC allocation limit and the
bytes in flight of GPU requests need a CUDA GPU (skipped without one, with the reason).

The daemon here is `tzip serve` with the limits' flags (`--max-regions`, `--max-ipc-handles`, `--max-inflight-bytes`).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import tzip
from tzip import _cuda
from tzip._errors import TzipDaemonError

from test_client_support import DaemonProcess, RawConn, sock_dir  # noqa: F401

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False): "
                                                 "the CUDA IPC limits are tested on a GPU host")

#: DaemonLimits fields -> the `tzip serve` flags that set them (src/cli/serve.ts).
FLAGS = {"maxRegionsPerSession": "--max-regions", "maxIpcHandlesPerSession": "--max-ipc-handles",
         "maxInflightBytesPerSession": "--max-inflight-bytes"}


@pytest.fixture
def limited(sock_dir):
    started: list[DaemonProcess] = []

    def start(**limits) -> DaemonProcess:
        flags = [x for k, v in limits.items() for x in (FLAGS[k], str(v))]
        d = DaemonProcess(os.path.join(sock_dir, f"s{len(started)}", "tzip.sock"), *flags).start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def bf16_weights(n: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_client_over_its_bytes_in_flight_gets_tzip_limit_and_goes_on(limited):
    d = limited(maxInflightBytesPerSession=1 << 20)
    big = bf16_weights((1 << 19) + 1, seed=1)  # one element more than 1 MiB of bf16
    small = bf16_weights(1 << 18, seed=2)
    # The limit of ZeroMQ requests' bytes (ring_entries=0: requests through the submission ring use memory the
    # client registered, which maxMappedBytesPerSession bounds, and the ring's entries).
    with tzip.connect(d.socket, spawn=False, strict=True, ring_entries=0) as a, tzip.connect(d.socket, spawn=False, strict=True) as b:
        with pytest.raises(TzipDaemonError) as e:
            a.compress(big)
        assert e.value.code == "TZIP_LIMIT"
        assert "maxInflightBytesPerSession = 1048576" in str(e.value) and "--max-inflight-bytes" in str(e.value)
        assert same_bits(a.decompress(a.compress(small)), small)
        assert same_bits(b.decompress(b.compress(small)), small)
    assert d.alive()


def _share(t: torch.Tensor, uuid: str) -> tuple[dict, bytes, int]:
    """``t``'s storage as a cuda_ipc handle (as the client sends it), with its ref-counter file and slot."""
    (_d, h, size, offset, rc, rco, _e, _s) = t.untyped_storage()._share_cuda_()
    return ({"kind": "cuda_ipc", "device_uuid": uuid, "device_index": t.device.index or 0, "handle": bytes(h),
             "offset": int(offset), "size": int(size), "ref_counter_handle": bytes(rc), "ref_counter_offset": int(rco)},
            bytes(rc), int(rco))


def _f32(handle: dict, offset: int, n: int) -> dict:
    return {"device": {"type": 2, "id": 0}, "dtype": {"code": 2, "bits": 32, "lanes": 1}, "shape": [n], "byte_offset": 0,
            "data": {**handle, "offset": handle["offset"] + offset, "size": 4 * n}}


def _region(handle: dict, offset: int, size: int) -> dict:
    return {**handle, "offset": handle["offset"] + offset, "size": size}


N = 1 << 20          # float32 elements of each tensor (4 MiB)
TENSOR = 4 * N
REGION = 3 * TENSOR  # each storage: tensor at 0, frame region after it (12 MiB: its own caching-allocator segment)


@needs_cuda
def test_cuda_ipc_allocations_above_the_limit_get_tzip_limit_and_idle_ones_make_room(limited):
    d = limited(maxIpcHandlesPerSession=2, maxInflightBytesPerSession=6 << 20)
    uuid = _cuda.device_uuid(0)
    # Three storages of 12 MiB: above the caching allocator's 10 MiB, each is its own allocation (its own IPC handle);
    # cached free segments of earlier tests could be split to serve them, so they go first.
    torch.cuda.empty_cache()
    stores = [torch.empty(REGION // 4, dtype=torch.float32, device="cuda") for _ in range(3)]
    for i, s in enumerate(stores):
        s[:N] = torch.randn(N, generator=torch.Generator().manual_seed(i)).cuda() * 0.02
    torch.cuda.synchronize()
    originals = [s[:N].clone() for s in stores]
    shares = [_share(s, uuid) for s in stores]
    handles = [h for h, _, _ in shares]
    assert len({h["handle"] for h in handles}) == 3, "the storages share an allocation; the test needs three"
    conn, other = RawConn(d.socket), RawConn(d.socket)
    try:
        assert conn.hello()["ok"] and other.hello()["ok"]

        def item(i: int) -> dict:
            return {"tensor": _f32(handles[i], 0, N), "out": _region(handles[i], TENSOR, 2 * TENSOR), "codec": "fast"}

        r = conn.call("compress", tensors=[item(0), item(1), item(2)])
        assert r["ok"] is False and r["error"]["code"] == "TZIP_LIMIT", r
        assert "maxIpcHandlesPerSession = 2" in r["error"]["message"] and "--max-ipc-handles" in r["error"]["message"], r
        stats = conn.req({"id": 3, "op": "stats", "sid": conn.sid})
        assert stats["session"]["gpu"]["allocations"] <= 2, stats
        # Two tensors in one request: above the 6 MiB of bytes in flight.
        r = conn.call("compress", tensors=[item(0), item(1)])
        assert r["ok"] is False and r["error"]["code"] == "TZIP_LIMIT" and "--max-inflight-bytes" in r["error"]["message"], r
        # One after the other, all three are served: idle allocations are closed to make room.
        frames = []
        for i in range(3):
            r = conn.call("compress", tensors=[item(i)])
            assert r["ok"], r
            frames.append(r["frames"][0]["bytes"])
            stats = conn.req({"id": 3, "op": "stats", "sid": conn.sid})
            assert stats["session"]["gpu"]["allocations"] <= 2, stats
        # Another session has its own limit, at the same time.
        r = other.call("compress", tensors=[item(2)])
        assert r["ok"], r
        # Back, bit-exact, into the zeroed tensors.
        for s in stores:
            s[:N].zero_()
        torch.cuda.synchronize()
        for i in range(3):
            r = conn.call("decompress", frames=[{"frame": _region(handles[i], TENSOR, frames[i]), "out": _f32(handles[i], 0, N)}])
            assert r["ok"], r
        torch.cuda.synchronize()
        for s, o in zip(stores, originals):
            assert torch.equal(s[:N].view(torch.int32), o.view(torch.int32))
        # Released: the daemon closes the allocations; nothing of them stays open in it.
        for c in (conn, other):
            r = c.call("release", handles=[h["handle"] for h in handles])
            assert r["ok"], r
        stats = conn.req({"id": 3, "op": "stats", "sid": conn.sid})
        assert stats["session"]["gpu"]["allocations"] == 0 and stats["gpu"]["allocations"] == 0, stats
        assert conn.alive() and other.alive()
    finally:
        conn.close()
        other.close()
        for _, rc, rco in shares:
            torch.UntypedStorage._release_ipc_counter_cuda(rc, rco)
    assert d.alive()
