"""Hostile and broken input sent straight to a real daemon over the socket: random bytes, wrong types,
unknown ops, oversized messages, huge declared sizes, other clients' memory, GPU handles, bad layouts.
Every one must get an error reply (with the request id where there is one) and the daemon must go on
serving; leases lapse for clients that go silent.
"""

from __future__ import annotations


import os
import random
import time

import msgpack
import pytest

from test_client_support import DaemonProcess, RawConn, daemon, shared_daemon, sock_dir  # noqa: F401


@pytest.fixture
def conn(shared_daemon):
    c = RawConn(shared_daemon.socket)
    assert c.hello()["ok"]
    yield c
    c.close()


def shm_file(name: str, size: int, fill: bytes = b"") -> str:
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.truncate(size)
        if fill:
            f.seek(0)
            f.write(fill)
    return path


@pytest.fixture
def files(conn):
    made = []

    def make(suffix: str, size: int, fill: bytes = b"", prefix: str | None = None) -> str:
        name = (prefix or conn.prefix) + suffix
        made.append(shm_file(name, size, fill))
        return name

    yield make
    for p in made:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def tensor(name: str, shape=(16,), code=2, bits=32, offset=0, size=None, byte_offset=0, device=1, strides=None):
    nbytes = bits // 8
    for d in shape:
        nbytes *= d
    t = {"device": {"type": device, "id": 0}, "dtype": {"code": code, "bits": bits, "lanes": 1}, "shape": list(shape),
         "byte_offset": byte_offset, "data": {"kind": "shm", "name": name, "offset": offset, "size": nbytes if size is None else size}}
    if strides is not None:
        t["strides"] = strides
    return t


def out(name: str, offset: int, size: int):
    return {"kind": "shm", "name": name, "offset": offset, "size": size}


def assert_error(reply, code, id_=7, contains=None):
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code, reply
    assert reply["id"] == id_
    if contains:
        assert contains in reply["error"]["message"], reply


def test_random_bytes_get_error_replies(conn):
    rng = random.Random(1234)
    for i in range(200):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
        if not junk:
            continue  # an empty message is ZeroMQ's connect/disconnect notice, not a request
        r = conn.send_raw(junk)
        assert r["ok"] is False and r["error"]["code"] == "TZIP_PROTOCOL", (i, junk, r)
    assert conn.alive()


@pytest.mark.parametrize("msg, where", [
    ([1, 2, 3], "map"),
    ({"op": "hello"}, "id"),
    ("hello", "map"),
    ({"id": "seven", "op": "heartbeat", "sid": "x"}, None),
    ({"id": 7, "op": 42}, "op"),
    ({"id": 7, "op": "format_disk"}, "unknown op"),
    ({"id": 7, "op": "heartbeat"}, "sid"),
    ({"id": 7, "op": "heartbeat", "sid": "0" * 32, "extra": 1}, "extra"),
    ({"id": 7, "op": "hello", "versions": [1], "pid": 1, "shm_prefix": "../../etc/"}, "shm_prefix"),
    ({"id": 7, "op": "hello", "versions": "1", "pid": 1, "shm_prefix": "tzip-1-0123abcd-"}, "versions"),
    ({"id": 7, "op": "hello", "versions": [1], "pid": -5, "shm_prefix": "tzip-1-0123abcd-"}, "pid"),
    ({"id": -1, "op": "stats"}, None),
    ({"id": 2 ** 64 - 1, "op": "stats"}, None),
])
def test_wrong_types_get_protocol_errors(conn, msg, where):
    r = conn.req(msg)
    assert r["ok"] is False and r["error"]["code"] == "TZIP_PROTOCOL", r
    if isinstance(msg, dict) and isinstance(msg.get("id"), int) and 0 <= msg["id"] < 2 ** 53:
        assert r["id"] == msg["id"]
    if where:
        assert where in r["error"]["message"], r
    assert conn.alive()


def test_wrong_types_inside_compress(conn, files):
    name = files("in", 4096)
    bad_tensors = [
        {**tensor(name), "shape": [-1]},
        {**tensor(name), "shape": [1.5]},
        {**tensor(name), "dtype": {"code": 2, "bits": 0, "lanes": 1}},
        {**tensor(name), "data": {"kind": "nfs", "name": name, "offset": 0, "size": 64}},
        {**tensor(name), "data": {"kind": "shm", "name": "../../etc/passwd", "offset": 0, "size": 64}},
        {**tensor(name), "data": {"kind": "shm", "name": name, "offset": "0", "size": 64}},
        {**tensor(name), "shape": list(range(1, 70))},
    ]
    for t in bad_tensors:
        r = conn.call("compress", tensors=[{"tensor": t, "out": out(name, 1024, 1024)}])
        assert_error(r, "TZIP_PROTOCOL")
    r = conn.call("compress", tensors="all of them")
    assert_error(r, "TZIP_PROTOCOL")
    assert conn.alive()


def test_oversized_message_gets_an_error_reply(conn):
    big = msgpack.packb({"id": 7, "op": "stats", "pad": b"x" * (2 << 20)}, use_bin_type=True)
    r = conn.send_raw(big)
    assert r["ok"] is False and r["error"]["code"] == "TZIP_TOO_LARGE"
    r = conn.send_raw(b"a", b"b", b"c")
    assert r["ok"] is False and r["error"]["code"] == "TZIP_PROTOCOL" and "one message part" in r["error"]["message"]
    assert conn.alive()


def test_huge_declared_sizes(conn, files):
    name = files("small", 8192)
    cases = [
        tensor(name, shape=(2 ** 26, 2 ** 26), size=64),             # 2^54 bytes: beyond 2^53
        tensor(name, shape=(2 ** 40,), size=2 ** 42),               # far beyond the file
        tensor(name, shape=(16,), offset=2 ** 53 - 1),              # region beyond the file
        tensor(name, shape=(16,), byte_offset=2 ** 50, size=64),    # tensor beyond its region
    ]
    for t in cases:
        r = conn.call("compress", tensors=[{"tensor": t, "out": out(name, 4096, 4096)}])
        assert r["ok"] is False and r["error"]["code"] in ("TZIP_HANDLE", "TZIP_TOO_LARGE"), r
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(16,)), "out": out(name, 4096, 2 ** 53 - 1)}])
    assert_error(r, "TZIP_HANDLE", contains="beyond the end")
    r = conn.req({"id": 7, "op": "compress", "sid": conn.sid, "tensors": [{"tensor": tensor(name), "out": out(name, 4096, 2 ** 64 - 1)}]})
    assert_error(r, "TZIP_PROTOCOL")  # 2^64 cannot be a size
    too_many = [{"tensor": tensor(name), "out": out(name, 4096, 1024)}] * 5000
    r = conn.call("compress", tensors=too_many)
    assert r["ok"] is False and r["error"]["code"] in ("TZIP_TOO_LARGE",), r
    assert conn.alive()


def test_other_clients_memory_is_refused(shared_daemon, files):
    a = RawConn(shared_daemon.socket)
    b = RawConn(shared_daemon.socket)
    try:
        assert a.hello()["ok"] and b.hello()["ok"]
        a_file = files("secret", 8192, os.urandom(64), prefix=a.prefix)
        b_file = files("mine", 8192, prefix=b.prefix)
        # b names a's file as input, then as output
        r = b.call("compress", tensors=[{"tensor": tensor(a_file), "out": out(b_file, 0, 4096)}])
        assert_error(r, "TZIP_HANDLE", contains="not this session's memory")
        r = b.call("compress", tensors=[{"tensor": tensor(b_file), "out": out(a_file, 0, 4096)}])
        assert_error(r, "TZIP_HANDLE", contains="not this session's memory")
        # b claims a's prefix at hello: refused while a lives
        r = b.req({"id": 7, "op": "hello", "versions": [1], "pid": b.pid + 1, "shm_prefix": a.prefix})
        assert_error(r, "TZIP_HANDLE", contains="another live session")
        # b uses a's session id: the id is a capability only for a's memory, so b is still refused other files
        r = b.req({"id": 7, "op": "compress", "sid": a.sid, "tensors": [{"tensor": tensor(b_file), "out": out(b_file, 4096, 4096)}]})
        assert_error(r, "TZIP_HANDLE")
        # files that are not under /dev/shm, or not files
        for bad in ("..", "."):
            r = b.call("compress", tensors=[{"tensor": tensor(bad), "out": out(b_file, 0, 4096)}])
            assert r["ok"] is False
        r = b.call("compress", tensors=[{"tensor": tensor(b.prefix + "missing"), "out": out(b_file, 0, 4096)}])
        assert_error(r, "TZIP_HANDLE", contains="does not exist")
        assert a.alive() and b.alive()
    finally:
        a.close()
        b.close()


def cuda_handle(pid: int, kind: bytes = b"c", uuid: str = "GPU-00000000-0000-0000-0000-000000000000", size: int = 2048,
                payload: bytes = b"\x01" * 64, offset: int = 0) -> dict:
    """A cuda_ipc handle as the Python client sends it (PyTorch's [version][kind] + cudaIpcMemHandle_t)."""
    return {"kind": "cuda_ipc", "device_uuid": uuid, "device_index": 0, "handle": b"\x02" + kind + payload, "offset": offset,
            "size": size, "ref_counter_handle": f"/torch_{pid}_123_0".encode(), "ref_counter_offset": 0}


def gpu_tensor(data: dict, shape=(1024,), code=4, bits=16) -> dict:
    return {"device": {"type": 2, "id": 0}, "dtype": {"code": code, "bits": bits, "lanes": 1}, "shape": list(shape),
            "byte_offset": 0, "data": data}


def test_gpu_handles_get_a_clear_error(conn, files):
    """Works on a daemon with or without GPUs: none of these can be served, each gets its own error."""
    name = files("cpu", 8192)
    unknown = gpu_tensor(cuda_handle(conn.pid))
    r = conn.call("compress", tensors=[{"tensor": unknown, "out": cuda_handle(conn.pid, payload=b"\x03" * 64)}])
    assert_error(r, "TZIP_NO_DEVICE")
    assert "no usable GPU" in r["error"]["message"] or "not visible" in r["error"]["message"], r
    assert r["error"]["index"] == 0
    # PyTorch's expandable segments: refused with the ways out, before anything else
    r = conn.call("compress", tensors=[{"tensor": gpu_tensor(cuda_handle(conn.pid, kind=b"e", payload=b"\x00" * 20)),
                                        "out": cuda_handle(conn.pid)}])
    assert_error(r, "TZIP_UNSUPPORTED", contains="expandable_segments")
    # memory another process shared (its PyTorch ref counter names its pid)
    other = cuda_handle(1)
    r = conn.call("compress", tensors=[{"tensor": gpu_tensor(other), "out": cuda_handle(conn.pid)}])
    assert_error(r, "TZIP_HANDLE", contains="another process")
    # CPU and GPU memory in one request
    cpu_desc_on_gpu = {**tensor(name), "device": {"type": 2, "id": 0}}
    r = conn.call("compress", tensors=[{"tensor": cpu_desc_on_gpu, "out": out(name, 4096, 4096)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT", contains="all on one GPU")
    r = conn.call("compress", tensors=[{"tensor": tensor(name), "out": cuda_handle(conn.pid)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT", contains="all on one GPU")
    r = conn.call("decompress", frames=[{"frame": cuda_handle(conn.pid), "out": tensor(name)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT", contains="all on one GPU")
    # malformed handles and events are protocol errors
    for bad in [b"\x01" * 64, b"\x02c" + b"\x01" * 63, b"\x09c" + b"\x01" * 64, b"\x02z" + b"\x01" * 64]:
        r = conn.call("compress", tensors=[{"tensor": gpu_tensor({**cuda_handle(conn.pid), "handle": bad}), "out": cuda_handle(conn.pid)}])
        assert_error(r, "TZIP_PROTOCOL", contains="handle")
    r = conn.call("compress", wait_event=b"\x00" * 10, tensors=[{"tensor": unknown, "out": cuda_handle(conn.pid)}])
    assert_error(r, "TZIP_PROTOCOL", contains="wait_event")
    r = conn.call("release", handles=[b"\x02c" + b"\x01" * 64])
    assert r["ok"] and r["released"] == 0
    assert conn.alive()


def test_bad_layouts_and_regions(conn, files):
    name = files("buf", 1 << 16, os.urandom(4096))
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(4, 4), strides=[1, 4]), "out": out(name, 8192, 4096)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT", contains="send the contiguous values")
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(1000,)), "out": out(name, 8192, 100)}])
    assert_error(r, "TZIP_HANDLE", contains="maxCompressedSize")
    assert r["error"]["need"] == 64 + 16 + 4000  # align16(48 + 8) + one chunk entry + 4000 bytes
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(1000,)), "out": out(name, 100, 8192)}])
    assert_error(r, "TZIP_HANDLE", contains="overlaps")
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(100,)), "out": out(name, 8192, 4096)},
                                       {"tensor": tensor(name, shape=(100,)), "out": out(name, 10000, 4096)}])
    assert_error(r, "TZIP_HANDLE", contains="overlaps")
    assert r["error"]["index"] == 1
    ok = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(1000,)), "out": out(name, 8192, 8192)}])
    assert ok["ok"], ok
    length = ok["frames"][0]["bytes"]
    # decompress: a frame that is not a frame, a wrong destination, a frame handle of the wrong length
    r = conn.call("decompress", frames=[{"frame": out(name, 20000, 200), "out": tensor(name, shape=(10,), offset=40000)}])
    assert r["ok"] is False and r["error"]["code"] in ("TZIP_CORRUPT", "TZIP_TRUNCATED"), r
    r = conn.call("decompress", frames=[{"frame": out(name, 8192, length), "out": tensor(name, shape=(999,), offset=40000)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT", contains="destination")
    r = conn.call("decompress", frames=[{"frame": out(name, 8192, length + 16), "out": tensor(name, shape=(1000,), offset=40000)}])
    assert_error(r, "TZIP_INVALID_ARGUMENT")
    r = conn.call("decompress", frames=[{"frame": out(name, 8192, length), "out": tensor(name, shape=(1000,), offset=40000)}])
    assert r["ok"] and r["tensors"][0]["nbytes"] == 4000
    with open(f"/dev/shm/{name}", "rb") as f:
        data = f.read()
    assert data[40000:44000] == data[:4000]
    assert conn.alive()


def test_version_negotiation(shared_daemon):
    c = RawConn(shared_daemon.socket)
    try:
        r = c.hello(versions=[99, 100])
        assert r["ok"] is False and r["error"]["code"] == "TZIP_VERSION" and r["error"]["versions"] == [1, 2, 3, 4]
        r = c.hello(versions=[1, 99])
        assert r["ok"] and r["version"] == 1
    finally:
        c.close()


def test_unknown_session_and_lease_lapse(sock_dir):
    d = DaemonProcess(os.path.join(sock_dir, "lease", "tzip.sock"), "--lease-ms", "300").start()
    c = RawConn(d.socket)
    try:
        r = c.req({"id": 7, "op": "heartbeat", "sid": "f" * 32})
        assert_error(r, "TZIP_SESSION", contains="hello again")
        assert c.hello()["ok"]
        name = c.prefix + "x"
        shm_file(name, 4096)
        assert c.call("compress", tensors=[{"tensor": tensor(name, shape=(100,)), "out": out(name, 512, 1024)}])["ok"]
        stats = c.req({"id": 1, "op": "stats", "sid": c.sid})
        assert stats["session"]["mapped"]["files"] == 1
        time.sleep(1.0)  # silent for more than the lease
        stats = c.req({"id": 1, "op": "stats"})
        assert stats["sessions"] == 0 and stats["sessions_ended"].get("lease") == 1 and stats["mapped"]["files"] == 0
        assert_error(c.call("heartbeat"), "TZIP_SESSION")
        # this process lives: its files were not removed
        assert os.path.exists(f"/dev/shm/{name}")
        os.unlink(f"/dev/shm/{name}")
    finally:
        c.close()
        d.stop()


@pytest.mark.parametrize("cut", ["input", "output"])
def test_a_file_shrunk_during_a_request_costs_only_that_request(conn, files, cut):
    """The client cuts its input file (read by the encoder) or its output file (the encoder writes the frame there)
    while the daemon compresses: without the addon's SIGBUS guard the daemon would die; with it, that request is
    answered TZIP_HANDLE and the daemon serves on."""
    n = 160 << 20  # a few hundred ms of coding here, so the cut lands mid-request
    name = files("big", n)
    with open(f"/dev/shm/{name}", "r+b") as f:
        f.write(os.urandom(1 << 20) * 160)
    frame = files("frame", n + (1 << 20))
    conn.sock.send(msgpack.packb({"id": 7, "op": "compress", "sid": conn.sid, "tensors": [
        {"tensor": tensor(name, shape=(n,), code=1, bits=8), "out": out(frame, 0, n + (1 << 20)), "codec": "bytes"}]},
        use_bin_type=True))
    time.sleep(0.05)
    os.truncate(f"/dev/shm/{name if cut == 'input' else frame}", 4096)
    r = msgpack.unpackb(conn.sock.recv(), raw=False)
    assert_error(r, "TZIP_HANDLE")
    assert "shrank while the daemon used it" in r["error"]["message"] or "beyond the end" in r["error"]["message"], r
    assert conn.alive()
    # The same files, grown back to their sizes: mapped afresh (never the cached mapping with its zero pages).
    os.truncate(f"/dev/shm/{frame}", n + (1 << 20))
    with open(f"/dev/shm/{name}", "r+b") as f:
        f.truncate(n)
        f.write(bytes(range(256)) * 64)
    r = conn.call("compress", tensors=[{"tensor": tensor(name, shape=(16384,), code=1, bits=8),
                                        "out": out(frame, 0, 1 << 20), "codec": "raw"}])
    assert r["ok"], r
    with open(f"/dev/shm/{frame}", "rb") as f:
        data = f.read(r["frames"][0]["bytes"])
    assert data.endswith(bytes(range(256)) * 64)  # a raw frame ends with the tensor's bytes


def test_daemon_survived_everything(shared_daemon):
    assert shared_daemon.alive()
    c = RawConn(shared_daemon.socket)
    try:
        s = c.req({"id": 1, "op": "stats"})
        assert s["ok"] and s["errors"].get("TZIP_PROTOCOL", 0) > 100
    finally:
        c.close()



def _allocation_end(t) -> int:
    """End address of the caching allocator's segment (one cudaMalloc) that holds tensor t."""
    import torch

    p = t.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= p < seg["address"] + seg["total_size"]:
            return seg["address"] + seg["total_size"]
    raise AssertionError("tensor not in any segment of the caching allocator")


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


@pytest.mark.skipif(not _gpu_available(), reason="needs a CUDA GPU")
def test_gpu_ranges_past_their_allocation_are_refused(conn):
    """A client that declares more bytes than its CUDA allocation holds (its real IPC handle, a larger size) cannot
    make the daemon's codec read or write past the allocation: the addon checks every range against the allocation
    holding its first byte (cuMemGetAddressRange), the request gets TZIP_INVALID_ARGUMENT, and the daemon serves the
    honest request after it, bit-exact."""
    import torch

    from tzip import _cuda
    from tzip._frame import max_compressed_size
    from tzip.reference import decode_frame

    uuid = _cuda.device_uuid(0)
    n = 4 << 20  # bf16 elements: 8 MiB, a segment of its own in PyTorch's large pool
    g = torch.Generator(device="cuda").manual_seed(5)
    src = (torch.randn(n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    past = _allocation_end(src) - src.data_ptr() + (64 << 20)  # bytes claimed from src's start: 64 MiB beyond its end
    frames = torch.empty(max_compressed_size(past, 1), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    s_src, s_fr = _cuda.share_storage(src.untyped_storage()), _cuda.share_storage(frames.untyped_storage())
    try:
        bad = gpu_tensor(s_src.wire(uuid, 0, size=past), shape=(past // 2,))
        r = conn.call("compress", tensors=[{"tensor": bad, "out": s_fr.wire(uuid, 0)}], codec="fast")
        assert_error(r, "TZIP_INVALID_ARGUMENT", contains="past the end of its allocation")
        # the honest request on the same handles, then its frame decoded by the reference decoder
        good = gpu_tensor(s_src.wire(uuid, 0, size=2 * n), shape=(n,))
        r = conn.call("compress", tensors=[{"tensor": good, "out": s_fr.wire(uuid, 0)}], codec="fast")
        assert r["ok"], r
        size = r["frames"][0]["bytes"]
        data, _ = decode_frame(frames[:size].cpu().numpy().tobytes())
        assert data == src.view(torch.int16).cpu().numpy().tobytes()
        # decompress into an output that claims to run past its allocation
        r = conn.call("decompress", frames=[{"frame": s_fr.wire(uuid, 0, size=size), "out": bad}])
        assert_error(r, "TZIP_INVALID_ARGUMENT", contains="past the end of its allocation")
        assert conn.alive()
    finally:
        conn.call("release", handles=[s_src.handle, s_fr.handle])
        s_src.release()
        s_fr.release()
