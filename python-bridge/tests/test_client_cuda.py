"""The GPU path: CUDA tensors through a real daemon with CUDA IPC handles and interprocess events.

Every dtype bit-exact (integer views, never floats), views at storage offsets, non-contiguous tensors, out=,
async calls on a side stream, serialisation of CUDA payloads, PyTorch's IPC ref counters released (memory flat
over 10,000 requests: torch's allocated/reserved bytes, the GPU's used memory, nvidia-smi's figure for this
process), expandable segments refused with an explanation, a client killed mid-request, hostile handles, a
daemon that sees no GPU (fallback and strict), a client whose device ordinals differ from the daemon's.

Needs a CUDA GPU; without one every GPU test is skipped with the reason (the unit tests of the share cache
and ref-counter bookkeeping at the end run anywhere).
"""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import textwrap
import time
import warnings

import pytest
import torch

import tzip.client as tz
import tzip._session
from tzip import _cuda
from tzip._dlpack import int_alias
from tzip.compressed import CompressedTensor

from test_client_support import PYTHON, DaemonProcess, RawConn, daemon, shared_daemon, sock_dir, wait_for, ALL_DTYPES, daemon_stats  # noqa: F401
from test_client_support import run_in_threads

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False): "
                                                 "the GPU path is tested on a GPU host")


def gpu_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a contiguous CPU integer tensor (compared with torch.equal: NaN payloads and -0.0 included)."""
    return int_alias(t.detach().contiguous()).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(gpu_bits(a), gpu_bits(b))


def random_cuda(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """A CUDA tensor of ``dtype`` with random bytes (every bit pattern), made as bytes and viewed."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)
    return raw.view(dtype).reshape(shape)


def bf16_weights(n: int, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)


@pytest.fixture(scope="module")
def client(shared_daemon):
    if not CUDA:
        pytest.skip("no CUDA GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the daemon serves this GPU
        c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    assert c.daemon_info.get("gpu") is True, c.daemon_info
    yield c
    c.close()


@pytest.fixture(scope="module")
def sharing_client(shared_daemon):
    """A client that hands every contiguous tensor over where it is (no copy into the staging arena)."""
    if not CUDA:
        pytest.skip("no CUDA GPU")
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True, gpu_share_min_bytes=0)
    yield c
    c.close()


# --- round trips ---------------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact_on_the_gpu(client, sharing_client, dtype):
    for c in (client, sharing_client):
        for shape in [(0,), (1,), (7, 13), (3, 1, 70001 // 3 + 1), (600_000,)]:
            t = random_cuda(dtype, shape, seed=hash((str(dtype), shape)) & 0xFFFF)
            ct = c.compress(t)
            assert isinstance(ct, CompressedTensor)
            assert ct.payload.device == t.device, "the payload stays on the tensor's GPU"
            assert ct.dtype == dtype and tuple(ct.shape) == shape and ct.nbytes == t.numel() * dtype.itemsize
            assert ct.codec in ("raw", "fast", "max", "bytes")
            back = c.decompress(ct)
            assert back.device == t.device
            assert same_bits(back, t), (dtype, shape, c.gpu_share_min_bytes)


@needs_cuda
@pytest.mark.parametrize("mb", [0.5, 8, 12.5, 25])
def test_frames_in_host_memory_decode_into_cuda_tensors_at_every_size(client, mb):
    """tzip.distributed over gloo holds GPU-coded frames in host memory and decodes them into CUDA tensors: frames of
    gradient-like bf16 moved to the CPU come back bit-exact on the GPU, one or two per blocking request, at the sizes
    of DDP buckets' shards. (On an H100, 2026-12-07, `tzip.bench.collectives --device cuda` of a 25 MB bf16 bucket in
    one piece failed with TZIP_CORRUPT from the GPU decode of such frames; this pins where to look.)"""
    t = bf16_weights(int(mb * 1e6) // 2, seed=int(mb * 10))
    ct = client.compress([t], codec="fast")[0]
    host = CompressedTensor(ct.payload.cpu(), ct.dtype, ct.shape, ct.codec, ct.nbytes)
    one = client.decompress([host], out=[torch.empty_like(t)])[0]
    two = client.decompress([host, host], out=[torch.empty_like(t), None])
    torch.cuda.synchronize()
    assert same_bits(one, t) and same_bits(two[0], t) and same_bits(two[1], t)


@needs_cuda
def test_two_sessions_coding_at_once_on_one_gpu_stay_bit_exact(shared_daemon):
    """Two clients (two rings, so two ring threads and streams in the daemon, as two ranks of one GPU have) compress
    and decompress at the same time, at sizes above the CUDA-graph limit (4 MiB: every call uploads its descriptors
    through the codec's shared pinned staging buffers) and below it. Each result equals its input bit for bit. (On an
    H100, 2026-12-07, two ranks' 12.5 MB shards coded at once hit cudaErrorIllegalAddress in the daemon: a staging
    buffer whose upload was not yet recorded was handed to the other thread, which overwrote its descriptors.)"""
    clients = [tz.connect(shared_daemon.socket, spawn=False, strict=True) for _ in range(2)]
    sizes = [6_250_000, 5_000_001, 1_000_000, 7_777_777]
    errors: list = []

    def work(k: int) -> None:
        c = clients[k]
        try:
            ts = [bf16_weights(n // 2, seed=100 * k + i) for i, n in enumerate(sizes)]
            for rep in range(12):
                t = ts[(rep + k) % len(ts)]
                ct = c.compress([t], codec="auto" if rep % 2 else "fast")[0]
                back = c.decompress([ct])[0]
                torch.cuda.synchronize()
                if not same_bits(back, t):
                    errors.append((k, rep, "differs"))
        except Exception as e:  # noqa: BLE001 - reported below, with which thread
            errors.append((k, "raised", repr(e)))

    try:
        run_in_threads(work, 2, 300)
        assert not errors, errors
        assert all(len(c.ring_info["rings"]) >= 1 for c in clients)  # both went through rings of their own
    finally:
        for c in clients:
            c.close()


@needs_cuda
def test_a_protocol_version_1_session_names_the_staging_buffer_in_full(shared_daemon, client, monkeypatch):
    """A client that speaks only version 1 (no handle tables) stages a batch with a full handle per region, and gets
    the same frames and tensors back as a version-2 client, which names the buffer once (docs/protocol.md)."""
    monkeypatch.setattr(tzip._session, "PROTOCOL_VERSIONS", [1])
    old = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    try:
        old._session.call("heartbeat", {})
        assert old._session.version == 1 and client._session.version >= 2  # the newest both speak (3 since jobs)
        batch = [random_cuda(torch.bfloat16, (37 + i, 5), seed=i) for i in range(12)] + [random_cuda(torch.int8, (1000,), seed=99)]
        v1, v2 = old.compress(batch), client.compress(batch)
        for a, b in zip(v1, v2):
            assert a.codec == b.codec and torch.equal(a.payload, b.payload)
        for back, t in zip(old.decompress(v2), batch):
            assert same_bits(back, t)
        for back, t in zip(client.decompress(v1), batch):
            assert same_bits(back, t)
    finally:
        old.close()


@needs_cuda
def test_frames_match_the_cpu_path_byte_for_byte(client):
    for dtype, codec in [(torch.bfloat16, "auto"), (torch.bfloat16, "max"), (torch.float32, "fast"), (torch.int32, "auto"),
                         (torch.float16, "raw"), (torch.float64, "bytes")]:
        t = random_cuda(dtype, (300, 301), seed=3) if not dtype.is_floating_point or codec == "raw" \
            else (torch.randn(300, 301) * 0.02).to(dtype).cuda()
        g, cpu = client.compress(t, codec=codec), client.compress(t.cpu(), codec=codec)
        assert g.codec == cpu.codec, (dtype, codec)
        assert torch.equal(g.payload.cpu(), cpu.payload), (dtype, codec)


@needs_cuda
@pytest.mark.parametrize("ring_entries", [0, None], ids=["zeromq", "ring"])
def test_a_cuda_tensor_without_a_codec_gets_fast_and_a_cpu_tensor_auto(shared_daemon, ring_entries):
    """codec=None (the default; tzip._codec_choice): CUDA tensors are coded `fast` (bf16 weights, where `auto` picks
    `max`), CPU tensors `auto`, in one call as in two; the frames equal the CPU path's of the named codec byte for
    byte. A named codec wins."""
    kw = {} if ring_entries is None else {"ring_entries": ring_entries}
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True, **kw)
    try:
        w = bf16_weights(200_000, seed=5)
        cpu_auto, cpu_fast = c.compress(w.cpu(), codec="auto"), c.compress(w.cpu(), codec="fast")
        assert cpu_auto.codec == "max" and cpu_fast.codec == "fast"  # the test means something only if auto picks max
        mixed = c.compress([w, w.cpu()])
        assert [x.codec for x in mixed] == ["fast", "max"]
        assert mixed[0].payload.device.type == "cuda" and torch.equal(mixed[0].payload.cpu(), cpu_fast.payload)
        assert torch.equal(mixed[1].payload, cpu_auto.payload)
        alone = c.compress_async(w).result(timeout=60)
        assert alone.codec == "fast" and torch.equal(alone.payload.cpu(), cpu_fast.payload)
        named = c.compress(w, codec="auto")
        assert named.codec == "max" and torch.equal(named.payload.cpu(), cpu_auto.payload)
        assert same_bits(c.decompress(mixed[0]), w) and same_bits(c.decompress(named), w)
    finally:
        c.close()


@needs_cuda
def test_a_batch_reports_each_frames_own_codec_as_the_cpu_path(client, sharing_client):
    """One request with `auto` picking differently per tensor (max, fast, bytes; an empty float tensor): the codecs
    the daemon reports (the addon's per-item report, one copy for the batch) and the frames equal the CPU path's,
    and the batch decompresses in one request (frame headers checked against their destinations)."""
    ts = [bf16_weights(40_000, seed=1).reshape(200, 200), random_cuda(torch.bfloat16, (30_000,), seed=2),
          (torch.randn(5_000) * 0.02).cuda(), random_cuda(torch.int32, (7, 1000), seed=3),
          torch.empty((0, 4), dtype=torch.bfloat16, device="cuda"), (torch.randn(64, 64) * 0.02).to(torch.float16).cuda(),
          bf16_weights(1, seed=4)]
    cpu = client.compress([t.cpu() for t in ts], codec="auto")
    assert {c.codec for c in cpu[:2]} == {"fast", "max"}, [c.codec for c in cpu]
    for c in (client, sharing_client):
        g = c.compress(ts, codec="auto")
        assert [x.codec for x in g] == [x.codec for x in cpu]
        for i, (x, y) in enumerate(zip(g, cpu)):
            assert torch.equal(x.payload.cpu(), y.payload), i
            assert x.payload.cpu()[7].item() == ("raw", "fast", "max", "bytes").index(x.codec), i  # header byte 7
        back = c.decompress(g)
        assert all(same_bits(b, t) for b, t in zip(back, ts))


@needs_cuda
@pytest.mark.parametrize("share_everything", [False, True], ids=["staged", "handed-over"])
def test_arange_view_at_a_storage_offset(client, sharing_client, share_everything):
    c = sharing_client if share_everything else client
    base = torch.arange(10, dtype=torch.bfloat16, device="cuda")
    view = base[3:7]
    assert view.storage_offset() == 3
    ct = c.compress(view)
    back = c.decompress(ct)
    want = torch.tensor([3, 4, 5, 6], dtype=torch.bfloat16)
    assert torch.equal(back.view(torch.int16).cpu(), want.view(torch.int16))
    assert torch.equal(base.view(torch.int16).cpu(), torch.arange(10, dtype=torch.bfloat16).view(torch.int16))  # untouched
    # a larger view deep inside a storage, handed over with its byte offset
    big = bf16_weights(1 << 21, seed=9)
    v = big[12345 : 12345 + 700_001]
    assert same_bits(c.decompress(c.compress(v)), v)


@needs_cuda
def test_non_contiguous_tensors_as_on_the_cpu(client):
    base = random_cuda(torch.float32, (64, 96), seed=1)
    views = {"transpose": base.t(), "columns": base[:, 3:50], "step": base[::3, ::2], "1-D step": base.view(-1)[5::7],
             "column of one": base[:, 4], "element": base[7, 9],
             "expanded": base[0:1].expand(10, 96), "channels_last": random_cuda(torch.float16, (2, 3, 8, 8), seed=4)
             .to(memory_format=torch.channels_last)}
    for name, v in views.items():
        ct = client.compress(v)
        assert tuple(ct.shape) == tuple(v.shape)
        back = client.decompress(ct)
        assert back.is_contiguous(), name
        assert same_bits(back, v.contiguous()), name


@needs_cuda
def test_out_on_the_gpu(client, sharing_client):
    for c in (client, sharing_client):
        for shape in [(17,), (1024, 1024)]:
            t = random_cuda(torch.bfloat16, shape, seed=len(shape))
            ct = c.compress(t)
            out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            assert c.decompress(ct, out=out) is out
            assert same_bits(out, t)
            # a non-contiguous destination (a column-major view)
            holder = torch.empty(tuple(reversed(shape)), dtype=torch.bfloat16, device="cuda")
            dest = holder.t() if len(shape) == 2 else holder
            c.decompress(ct, out=dest)
            assert same_bits(dest, t)
    # CPU payload into a GPU destination, GPU payload into a CPU destination
    t = random_cuda(torch.float32, (5000,), seed=8)
    ct = client.compress(t)
    host_ct = CompressedTensor(ct.payload.cpu(), ct.dtype, ct.shape, ct.codec, ct.nbytes)
    out = torch.empty(5000, dtype=torch.float32, device="cuda")
    assert same_bits(client.decompress(host_ct, out=out), t)
    cpu_out = torch.empty(5000, dtype=torch.float32)
    assert same_bits(client.decompress(ct, out=cpu_out), t)


@needs_cuda
def test_batches_mixing_cpu_and_gpu_tensors(client):
    ts = [random_cuda(torch.bfloat16, (1000 + i,), seed=i) for i in range(50)]
    ts += [random_cuda(torch.float32, (300,), seed=99).cpu(), bf16_weights(3_000_000, seed=5)]
    cts = client.compress(ts)
    assert [ct.payload.device for ct in cts] == [t.device for t in ts]
    back = client.decompress(cts)
    assert all(same_bits(a, b) for a, b in zip(back, ts))


@needs_cuda
def test_async_calls_on_a_side_stream(client):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = bf16_weights(2_000_000, seed=11) * 3  # produced on the side stream
        small = random_cuda(torch.int16, (333,), seed=12) + 1
        fut = client.compress_async([t, small])
        cts = fut.result(timeout=60)
        back = client.decompress_async(cts).result(timeout=60)
        ok = [same_bits(a, b) for a, b in zip(back, [t, small])]
    side.synchronize()
    assert all(ok)


@needs_cuda
def test_serialised_cuda_payloads(client, tmp_path):
    t = bf16_weights(100_000, seed=2)
    ct = client.compress(t)
    again = CompressedTensor.from_bytes(ct.to_bytes(), device="cuda")
    assert again.payload.device.type == "cuda"
    assert same_bits(client.decompress(again), t)
    host = CompressedTensor.from_bytes(ct.to_bytes())
    assert host.payload.device.type == "cpu"
    assert same_bits(client.decompress(host), t.cpu())
    buf = io.BytesIO()
    torch.save({"ct": ct}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["ct"]
    assert loaded.payload.device == ct.payload.device  # torch.load restores the payload on the GPU it was saved from
    assert same_bits(client.decompress(loaded), t)


# --- PyTorch's IPC ref counters: memory flat over many requests ---------------------------------------------------

def _nvidia_smi_used_mib(pid: int) -> int | None:
    """This process's used GPU memory per nvidia-smi (None when nvidia-smi is missing or cannot see this pid)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    total = None
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            total = (total or 0) + int(parts[1])
    return total


@needs_cuda
@pytest.mark.parametrize("share_everything", [False, True], ids=["staged", "handed-over"])
def test_ten_thousand_requests_keep_memory_flat(client, sharing_client, shared_daemon, share_everything):
    """Staged: the same small tensor, copied into the arena. Handed over: a new tensor every time, shared with
    _share_cuda_ (a new ref-counter slot each time): if the client did not release PyTorch's counters, every freed
    block would stay in PyTorch's limbo and allocated memory would grow."""
    c = sharing_client if share_everything else client
    fixed = bf16_weights(64, seed=1)

    def once(i: int) -> None:
        t = fixed if not share_everything else bf16_weights(64, seed=i % 7) + 0  # a new storage each time
        back = c.decompress(c.compress(t))
        if i % 1000 == 0:
            assert same_bits(back, t)

    for i in range(200):  # warm-up: arena buffers, events, the daemon's mappings
        once(i)
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free0, _ = torch.cuda.mem_get_info()
    smi0 = _nvidia_smi_used_mib(os.getpid())
    for i in range(10_000):
        once(i)
    torch.cuda.synchronize()
    alloc1, reserved1 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free1, _ = torch.cuda.mem_get_info()
    smi1 = _nvidia_smi_used_mib(os.getpid())
    assert alloc1 <= alloc0, f"allocated grew {alloc0} -> {alloc1}: blocks kept in PyTorch's IPC limbo"
    assert reserved1 <= reserved0, f"reserved grew {reserved0} -> {reserved1}"
    assert free0 - free1 <= 8 << 20, f"the GPU's used memory grew by {(free0 - free1) >> 20} MiB"
    if smi0 is not None and smi1 is not None:
        assert smi1 <= smi0 + 2, f"nvidia-smi: this process grew {smi0} -> {smi1} MiB"
    else:
        warnings.warn("nvidia-smi does not list this process (pid namespace?): its per-process check was skipped")
    st = daemon_stats(shared_daemon.socket)
    assert st["gpu"]["allocations"] < 64, st["gpu"]  # the daemon keeps a handful of mappings, not one per request


# --- expandable segments ---------------------------------------------------------------------------------------------

EXPANDABLE = textwrap.dedent("""
    import sys, torch
    import tzip.client as tz
    c = tz.connect(sys.argv[1], spawn=False, strict=True)
    for n in (64, 4 << 20):  # staged, and handed over where it is
        t = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        try:
            back = c.decompress(c.compress(t))
            print("OK", n, torch.equal(back.view(torch.int16), t.view(torch.int16)), flush=True)
        except tz.TzipDaemonError as e:
            print("REFUSED", n, e.code, e.detail.replace("\\n", " "), flush=True)
    c.close()
""")


@needs_cuda
def test_expandable_segments_are_refused_with_the_way_out(shared_daemon):
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run([PYTHON, "-c", EXPANDABLE, shared_daemon.socket], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("OK", "REFUSED"))]
    assert len(lines) == 2, out.stdout + out.stderr[-3000:]
    for ln in lines:
        if ln.startswith("OK"):
            assert ln.endswith("True"), ln  # served (if expandable segments ever are): bit-exact
        else:
            assert " TZIP_UNSUPPORTED " in ln and "expandable_segments" in ln and "PYTORCH_CUDA_ALLOC_CONF" in ln, ln
    assert daemon_stats(shared_daemon.socket)["ok"]


# --- processes: a client killed mid-request, hostile handles -------------------------------------------------------

KILLED = textwrap.dedent("""
    import sys, torch
    import tzip.client as tz
    c = tz.connect(sys.argv[1], spawn=False, strict=True)
    t = (torch.randn(64 << 20, device="cuda") * 0.02).to(torch.bfloat16)  # 128 MB
    c.compress(t)
    print("started", flush=True)
    while True:
        c.decompress(c.compress([t, t[1:], t[2:]], codec="max"))
""")


@needs_cuda
def test_a_client_killed_mid_request_leaves_the_daemon_serving(daemon):
    before = daemon_stats(daemon.socket)
    p = subprocess.Popen([PYTHON, "-c", KILLED, daemon.socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"started", p.stderr.read().decode()[-3000:] if p.poll() is not None else ""
        time.sleep(0.3)
        assert daemon_stats(daemon.socket)["gpu"]["allocations"] > 0
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    # its session ends (disconnect, or the lease) and the daemon closes every mapping it held
    assert wait_for(lambda: daemon_stats(daemon.socket)["sessions"] == before["sessions"], 30)
    assert wait_for(lambda: daemon_stats(daemon.socket)["gpu"]["allocations"] == before["gpu"]["allocations"], 30), \
        daemon_stats(daemon.socket)["gpu"]
    assert daemon.alive()
    with tz.connect(daemon.socket, spawn=False, strict=True) as c:
        t = bf16_weights(4 << 20, seed=3)
        assert same_bits(c.decompress(c.compress(t)), t)


SHARE_ONE = textwrap.dedent("""
    import sys, torch
    t = torch.ones(1 << 20, device="cuda")
    (_d, handle, size, offset, rc, rco, _e, _s) = t.untyped_storage()._share_cuda_()
    print(handle.hex(), offset, size, rc.decode(), rco, flush=True)
    sys.stdin.read()  # keep the memory alive until told
""")


@needs_cuda
def test_hostile_handles_get_errors_and_the_daemon_survives(shared_daemon):
    uuid = _cuda.device_uuid(0)
    conn = RawConn(shared_daemon.socket)
    other = subprocess.Popen([PYTHON, "-c", SHARE_ONE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert conn.hello()["ok"]
        mine = f"/torch_{conn.pid}_1_0".encode()

        def ipc(handle: bytes, rc: bytes = mine, offset: int = 0, size: int = 4 << 20) -> dict:
            return {"kind": "cuda_ipc", "device_uuid": uuid, "device_index": 0, "handle": handle, "offset": offset,
                    "size": size, "ref_counter_handle": rc, "ref_counter_offset": 0}

        def tensor(data: dict, n: int = 1 << 20) -> dict:
            return {"device": {"type": 2, "id": 0}, "dtype": {"code": 2, "bits": 32, "lanes": 1}, "shape": [n],
                    "byte_offset": 0, "data": data}

        for _ in range(5):  # random cudaIpcMemHandle_t bytes: CUDA refuses them, the daemon answers
            h = b"\x02c" + os.urandom(64)
            r = conn.call("compress", tensors=[{"tensor": tensor(ipc(h)), "out": ipc(b"\x02c" + os.urandom(64))}])
            assert r["ok"] is False and r["error"]["code"] == "TZIP_HANDLE", r
        # another process's live share, named as it is (its ref counter carries its pid): not this session's memory
        line = other.stdout.readline().decode().split()
        assert len(line) == 5, other.stderr.read().decode()[-2000:] if other.poll() is not None else line
        handle, offset, size, rc = bytes.fromhex(line[0]), int(line[1]), int(line[2]), line[3].encode()
        r = conn.call("compress", tensors=[{"tensor": tensor(ipc(handle, rc, offset, size)), "out": ipc(handle, rc, offset, size)}])
        assert r["ok"] is False and r["error"]["code"] == "TZIP_HANDLE" and "another process" in r["error"]["message"], r
        # a random event handle with memory of this process (shared as the client shares it)
        t = torch.ones(3 << 20, device="cuda")
        (_d, h, size, offset, rc, rco, _e, _s) = t.untyped_storage()._share_cuda_()
        try:
            mem = ipc(bytes(h), bytes(rc), int(offset), int(size))
            r = conn.call("compress", wait_event=os.urandom(64), tensors=[{"tensor": tensor(mem), "out": {**mem, "offset": int(offset) + (4 << 20), "size": 8 << 20}}])
            assert r["ok"] is False and r["error"]["code"] == "TZIP_HANDLE" and "wait_event" in r["error"]["message"], r
            # and the same memory, named right, is served
            r = conn.call("compress", tensors=[{"tensor": tensor(mem), "out": {**mem, "offset": int(offset) + (4 << 20), "size": 8 << 20}}])
            assert r["ok"] is True, r
            torch.cuda.synchronize()
        finally:
            torch.UntypedStorage._release_ipc_counter_cuda(bytes(rc), int(rco))
        assert conn.alive()
    finally:
        conn.close()
        other.stdin.close()
        other.wait(30)
    with tz.connect(shared_daemon.socket, spawn=False, strict=True) as c:
        x = bf16_weights(10_000, seed=4)
        assert same_bits(c.decompress(c.compress(x)), x)


# --- a daemon without this GPU ---------------------------------------------------------------------------------------

@needs_cuda
def test_a_daemon_without_gpus_falls_back(sock_dir, monkeypatch):
    torch.cuda.init()  # before hiding the GPUs: CUDA_VISIBLE_DEVICES is read once, at initialisation
    torch.ones(1, device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the daemon started now
    d = DaemonProcess(os.path.join(sock_dir, "nogpu", "tzip.sock")).start()
    monkeypatch.undo()
    try:
        t = bf16_weights(100_000, seed=6)
        c = tz.connect(d.socket, spawn=False)
        try:
            assert c.daemon_info["gpu"] is False
            with pytest.warns(RuntimeWarning, match="uncompressed"):
                ct = c.compress(t)
            assert ct.codec == "raw" and ct.payload.device == t.device
            assert same_bits(c.decompress(ct), t)
            cpu_ct = c.compress(t.cpu(), codec="max")  # a frame of another codec decompresses through the CPU
            back = c.decompress(CompressedTensor(cpu_ct.payload.cuda(), cpu_ct.dtype, cpu_ct.shape, cpu_ct.codec, cpu_ct.nbytes))
            assert back.device.type == "cuda" and same_bits(back, t)
        finally:
            c.close()
        strict = tz.connect(d.socket, spawn=False, strict=True)
        try:
            with pytest.raises(tz.DeviceUnavailableError) as e:
                strict.compress(t)
            assert e.value.code == "TZIP_NO_DEVICE"
        finally:
            strict.close()
    finally:
        d.stop()


MAPPED = textwrap.dedent("""
    import sys, torch
    import tzip.client as tz
    c = tz.connect(sys.argv[1], spawn=False, strict=True)
    t = (torch.randn(1 << 20, device="cuda:0") * 0.02).to(torch.bfloat16)
    back = c.decompress(c.compress(t))
    print("SAME" if torch.equal(back.view(torch.int16), t.view(torch.int16)) else "DIFFERENT", c.daemon_info["gpus"], flush=True)
    c.close()
""")


@needs_cuda
@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs 2 GPUs (ordinals that differ between client and daemon)")
def test_gpus_are_matched_by_uuid_not_ordinal(shared_daemon):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}  # the client's cuda:0 is the daemon's cuda:1
    out = subprocess.run([PYTHON, "-c", MAPPED, shared_daemon.socket], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("SAME"), out.stdout + out.stderr[-3000:]


# --- unit tests that run anywhere: share cache and ref-counter bookkeeping ------------------------------------------

def test_share_cache_shares_a_storage_once_while_it_lives():
    made = []

    def fake_share(storage):
        made.append(storage.data_ptr())
        return _cuda.Share(b"\x02c" + bytes(64), 0, storage.nbytes(), b"/torch_1_2_3", len(made))

    cache = _cuda.ShareCache(fake_share)
    a = torch.zeros(100)
    s1, new1 = cache.get(a.untyped_storage())
    s2, new2 = cache.get(a[10:].untyped_storage())  # a view: the same storage
    assert new1 and not new2 and s1 is s2 and len(made) == 1
    b = torch.zeros(100)
    _, new3 = cache.get(b.untyped_storage())
    assert new3 and len(made) == 2
    b.untyped_storage().resize_(100_000)  # new memory behind the same storage: shared again
    _, new4 = cache.get(b.untyped_storage())
    assert new4 and len(made) == 3
    del a, s1, s2
    for _ in range(300):  # past the purge limit: dead storages are forgotten
        cache.get(torch.zeros(1).untyped_storage())
    assert len(cache) < 300


def test_share_counters_are_released_once_and_never_after_a_lost_request(monkeypatch):
    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda handle, offset: released.append((handle, offset))), raising=False)
    s = _cuda.Share(b"\x02c" + bytes(64), 0, 10, b"/torch_1_2_3", 5)
    s.release()
    s.release()
    assert released == [(b"/torch_1_2_3", 5)]
    lost = _cuda.Share(b"\x02c" + bytes(64), 0, 10, b"/torch_1_2_4", 6)
    lost.poison()
    lost.release()
    assert released == [(b"/torch_1_2_3", 5)]
    w = s.wire("GPU-x", 0, 64, 16)
    assert w["offset"] == 64 and w["size"] == 16 and w["handle"] == s.handle and w["ref_counter_handle"] == b"/torch_1_2_3"


def test_cuda_tensors_need_no_gpu_to_be_refused_clearly():
    if CUDA:
        pytest.skip("this machine has a GPU")
    with pytest.raises(tz.TzipDaemonError):
        tz._device(torch.empty(1, device="meta"))
