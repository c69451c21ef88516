"""The controls of docs/security.md, each proved against a real `tzip serve` over its real socket with real
/dev/shm files: only this user's processes reach the socket (the folder's mode and, under it, the kernel's peer
credentials); a request reaches only memory its own session may name, also through hard links and symlinks and
after a release; the daemon reads and writes only inside the regions named (canary bytes around them stay);
size fields are checked before anything is allocated, in the daemon (transport frames, MessagePack lengths,
frame headers) and in the Python readers (frame headers, containers, safetensors headers).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
import tracemalloc

import msgpack
import pytest
import torch

from test_client_hostile import assert_error, out, tensor
from test_client_support import PYTHON, RawConn, shared_daemon  # noqa: F401

import tzip
from tzip import _container, _frame
from tzip._xxh32 import xxh32

CANARY = 0xA5


@pytest.fixture
def files():
    made: list[str] = []

    def make(name: str, size: int, fill: bytes = b"", byte: int = 0) -> str:
        path = f"/dev/shm/{name}"
        with open(path, "wb") as f:
            f.write(bytes([byte]) * size if byte else b"")
            f.truncate(size)
            if fill:
                f.seek(0)
                f.write(fill)
        made.append(path)
        return name

    make.made = made  # type: ignore[attr-defined]
    yield make
    for p in made:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


@pytest.fixture
def conns(shared_daemon):
    made: list[RawConn] = []

    def make() -> RawConn:
        c = RawConn(shared_daemon.socket)
        assert c.hello()["ok"]
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def bf16(n: int, seed: int = 0) -> bytes:
    """Bytes of a bf16 tensor of small weights (a real-looking distribution, so `auto` picks a float codec)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def bf16_tensor(name: str, n: int, offset: int = 0) -> dict:
    return tensor(name, shape=(n,), code=4, bits=16, offset=offset)


def read(name: str, offset: int = 0, size: int | None = None) -> bytes:
    with open(f"/dev/shm/{name}", "rb") as f:
        f.seek(offset)
        return f.read() if size is None else f.read(size)


def vm_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --- who can connect ---------------------------------------------------------------------------------------------

def _zmtp_greeting_reply(path: str, uid: int | None) -> bytes:
    """Connects to the ipc socket at ``path`` (as ``uid`` when given, in a child process), sends a ZMTP 3.0 greeting
    and returns what the daemon answered within 2 s (its own greeting, or b'' when it closed the connection)."""
    code = (
        "import socket,sys,os\n"
        f"uid={uid!r}\n"
        "if uid is not None:\n"
        "    os.setgid(uid); os.setuid(uid)\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(sys.argv[1])\n"
        "got=b''\n"
        "try:\n"
        "    s.sendall(b'\\xff'+b'\\0'*8+b'\\x7f'+b'\\x03\\x00'+b'NULL'+b'\\0'*16+b'\\0'+b'\\0'*31)\n"
        "    while len(got)<64:\n"
        "        b=s.recv(64-len(got))\n"
        "        if not b: break\n"
        "        got+=b\n"
        "except (socket.timeout, ConnectionResetError, BrokenPipeError): pass\n"
        "sys.stdout.write(got.hex())\n"
    )
    r = subprocess.run([sys.executable if uid is not None else PYTHON, "-c", code, path], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    return bytes.fromhex(r.stdout)


def test_socket_folder_and_socket_are_private(shared_daemon):
    folder = os.path.dirname(shared_daemon.socket)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(shared_daemon.socket).st_mode & 0o777 == 0o600
    assert os.stat(folder).st_uid == os.getuid()
    # This user's process is answered with the daemon's ZMTP greeting.
    got = _zmtp_greeting_reply(shared_daemon.socket, None)
    assert got[:1] == b"\xff" and got[9:10] == b"\x7f", got


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a client as another user (nobody)")
def test_another_user_is_dropped_by_peer_credentials_even_with_the_folder_open(shared_daemon, tmp_path):
    """The folder's mode 0700 keeps other users out; should it be opened (by hand, a umask, a bind mount), the
    daemon's ZMQ_IPC_FILTER_UID still drops their connections by the kernel's SO_PEERCRED uid: not one byte back."""
    folder = os.path.dirname(shared_daemon.socket)
    nobody = 65534
    parents = []
    p = folder
    while p not in ("/", ""):
        parents.append((p, os.stat(p).st_mode & 0o7777))
        p = os.path.dirname(p)
    try:
        for path, mode in parents:
            os.chmod(path, mode | 0o055 if path != folder else 0o755)
        os.chmod(shared_daemon.socket, 0o777)
        assert _zmtp_greeting_reply(shared_daemon.socket, nobody) == b""
        assert _zmtp_greeting_reply(shared_daemon.socket, None)[:1] == b"\xff"  # this user still is served
    finally:
        os.chmod(shared_daemon.socket, 0o600)
        for path, mode in parents:
            os.chmod(path, mode)
    c = RawConn(shared_daemon.socket)
    try:
        assert c.hello()["ok"] and c.alive()
    finally:
        c.close()


# --- whose memory: links, other sessions, release ------------------------------------------------------------------

def test_two_hard_links_to_one_file_are_one_file_for_the_overlap_check(conns, files):
    c = conns()
    n = 4096
    data = bf16(n)
    cap = _frame.max_compressed_size(2 * n, 1)
    a = files(c.prefix + "a", 2 * n + cap + 4096, data)
    b = c.prefix + "b"
    os.link(f"/dev/shm/{a}", f"/dev/shm/{b}")
    files.made.append(f"/dev/shm/{b}")
    # Output over the input, named through the other link: the encoder would read bytes it is overwriting.
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(a, n), "out": out(b, 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="overlaps")
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(b, n), "out": out(a, 100, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="overlaps")
    assert read(a, 0, 2 * n) == data  # nothing was written
    # Disjoint regions through the two names are fine, and the round trip is bit-exact.
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(a, n), "out": out(b, 2 * n, cap)}])
    assert r["ok"], r
    fb = r["frames"][0]["bytes"]
    back = files(c.prefix + "back", 2 * n)
    r = c.call("decompress", frames=[{"frame": out(a, 2 * n, fb), "out": bf16_tensor(back, n)}])
    assert r["ok"], r
    assert read(back) == data
    # A decompress whose destination overlaps its frame through the other name.
    r = c.call("decompress", frames=[{"frame": out(a, 2 * n, fb), "out": bf16_tensor(b, n, offset=2 * n)}])
    assert_error(r, "TZIP_HANDLE", contains="overlaps")


def test_links_to_another_sessions_file_are_refused(conns, files):
    victim, thief = conns(), conns()
    n = 2048
    secret = bf16(n, seed=7)
    cap = _frame.max_compressed_size(2 * n, 1)
    v = files(victim.prefix + "secret", 2 * n, secret)
    vout = files(victim.prefix + "frame", cap)
    r = victim.call("compress", tensors=[{"tensor": bf16_tensor(v, n), "out": out(vout, 0, cap)}])
    assert r["ok"], r  # the victim's file is mapped by its session now
    tout = files(thief.prefix + "frame", cap)
    hard = thief.prefix + "hardlink"
    os.link(f"/dev/shm/{v}", f"/dev/shm/{hard}")
    files.made.append(f"/dev/shm/{hard}")
    r = thief.call("compress", tensors=[{"tensor": bf16_tensor(hard, n), "out": out(tout, 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="another session")
    # As a destination too (the thief would write into the victim's memory).
    r = thief.call("compress", tensors=[{"tensor": bf16_tensor(tout, 16), "out": out(hard, 0, 2 * n)}])
    assert_error(r, "TZIP_HANDLE", contains="another session")
    assert read(v) == secret
    # A symlink is no file of the thief's, whatever it points to.
    sym = thief.prefix + "symlink"
    os.symlink(f"/dev/shm/{v}", f"/dev/shm/{sym}")
    files.made.append(f"/dev/shm/{sym}")
    r = thief.call("compress", tensors=[{"tensor": bf16_tensor(sym, n), "out": out(tout, 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="symlink")
    own = files(thief.prefix + "own", 2 * n, secret)
    sym_own = thief.prefix + "symlink-own"
    os.symlink(f"/dev/shm/{own}", f"/dev/shm/{sym_own}")
    files.made.append(f"/dev/shm/{sym_own}")
    r = thief.call("compress", tensors=[{"tensor": bf16_tensor(sym_own, n), "out": out(tout, 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="symlink")
    # The victim is unaffected and the thief is still served with its own memory.
    assert victim.call("compress", tensors=[{"tensor": bf16_tensor(v, n), "out": out(vout, 0, cap)}])["ok"]
    assert thief.call("compress", tensors=[{"tensor": bf16_tensor(own, n), "out": out(tout, 0, cap)}])["ok"]


def test_sessions_of_one_process_share_its_torch_files_but_not_each_others(conns, files):
    """PyTorch's file_system-strategy files (torch_<pid>_*) are the process's: every session of it may name them at
    once. A session's own files stay its own, also when linked under a torch_ name."""
    a, b = conns(), conns()
    n = 2048
    data = bf16(n, 5)
    cap = _frame.max_compressed_size(2 * n, 1)
    shared = files(f"torch_{os.getpid()}_{os.urandom(4).hex()}_0", 2 * n, data)
    for c in (a, b):
        dst = files(c.prefix + "dst", cap)
        r = c.call("compress", tensors=[{"tensor": bf16_tensor(shared, n), "out": out(dst, 0, cap)}])
        assert r["ok"], r
    mine = files(a.prefix + "mine", 2 * n, data)
    assert a.call("compress", tensors=[{"tensor": bf16_tensor(mine, n), "out": out(a.prefix + "dst", 0, cap)}])["ok"]
    alias = f"torch_{os.getpid()}_{os.urandom(4).hex()}_1"
    os.link(f"/dev/shm/{mine}", f"/dev/shm/{alias}")
    files.made.append(f"/dev/shm/{alias}")
    r = b.call("compress", tensors=[{"tensor": bf16_tensor(alias, n), "out": out(b.prefix + "dst", 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="another session")


def test_released_regions_and_ended_sessions_cannot_be_used(conns, files):
    c = conns()
    n = 2048
    first, second = bf16(n, 1), bf16(n, 2)
    cap = _frame.max_compressed_size(2 * n, 1)
    src = files(c.prefix + "src", 2 * n, first)
    dst = files(c.prefix + "dst", cap)
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(src, n), "out": out(dst, 0, cap)}])
    assert r["ok"], r
    r = c.call("release", names=[src, dst])
    assert r["ok"] and r["released"] == 2, r
    assert c.req({"id": 7, "op": "stats", "sid": c.sid})["session"]["mapped"]["files"] == 0
    # The client removes the file: the daemon has nothing of it left to use.
    os.unlink(f"/dev/shm/{src}")
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(src, n), "out": out(dst, 0, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="does not exist")
    # A new file under the old name is a new file (its bytes, not the old mapping's).
    files(c.prefix + "src", 2 * n, second)
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(src, n), "out": out(dst, 0, cap)}])
    assert r["ok"], r
    back = files(c.prefix + "back", 2 * n)
    r = c.call("decompress", frames=[{"frame": out(dst, 0, r["frames"][0]["bytes"]), "out": bf16_tensor(back, n)}])
    assert r["ok"] and read(back) == second
    # An ended session's id opens nothing any more.
    sid = c.sid
    assert c.call("release", end=True)["ok"]
    r = c.req({"id": 7, "op": "compress", "sid": sid, "tensors": [{"tensor": bf16_tensor(src, n), "out": out(dst, 0, cap)}]})
    assert_error(r, "TZIP_SESSION")


# --- inside the regions ----------------------------------------------------------------------------------------------

def test_reads_and_writes_stay_inside_the_regions(conns, files):
    """Every hostile region is refused and leaves the file as it was; a served request writes only its frame /
    tensor bytes (canaries right before and after them stay)."""
    c = conns()
    n = 1024
    data = bf16(n, 3)
    size = 64 << 10
    f = files(c.prefix + "canary", size, byte=CANARY)
    with open(f"/dev/shm/{f}", "r+b") as fh:
        fh.seek(4096)
        fh.write(data)
    before = read(f)
    cap = _frame.max_compressed_size(2 * n, 1)
    o = 16384
    hostile = [
        ("offset past the end", {"tensor": bf16_tensor(f, n, offset=size - 16), "out": out(f, o, cap)}, "TZIP_HANDLE"),
        ("output past the end", {"tensor": bf16_tensor(f, n, offset=4096), "out": out(f, size - 64, cap)}, "TZIP_HANDLE"),
        ("offset + size overflowing 2^53", {"tensor": bf16_tensor(f, n, offset=4096), "out": out(f, 2 ** 53 - 1, 2 ** 53 - 1)}, "TZIP_HANDLE"),
        ("negative offset", {"tensor": bf16_tensor(f, n, offset=-1), "out": out(f, o, cap)}, "TZIP_PROTOCOL"),
        ("negative size", {"tensor": bf16_tensor(f, n, offset=4096), "out": out(f, o, -cap)}, "TZIP_PROTOCOL"),
        ("byte_offset past the region", {"tensor": {**bf16_tensor(f, n, offset=4096), "byte_offset": 2}, "out": out(f, o, cap)}, "TZIP_HANDLE"),
        ("strides reaching outside", {"tensor": {**tensor(f, shape=(4, 256), code=4, bits=16, offset=4096), "strides": [100000, 1]},
                                      "out": out(f, o, cap)}, "TZIP_INVALID_ARGUMENT"),
        ("negative strides", {"tensor": {**tensor(f, shape=(4, 256), code=4, bits=16, offset=4096), "strides": [-256, 1]},
                              "out": out(f, o, cap)}, "TZIP_INVALID_ARGUMENT"),
        ("output below the frame bound", {"tensor": bf16_tensor(f, n, offset=4096), "out": out(f, o, cap - 1)}, "TZIP_HANDLE"),
    ]
    for what, item, code in hostile:
        r = c.call("compress", tensors=[item])
        assert r["ok"] is False and r["error"]["code"] == code, (what, r)
        assert read(f) == before, what
    # Version 2's handle table: a reference past its entry.
    v2 = conns()
    assert v2.hello(versions=[2])["ok"]  # the same client again, speaking version 2
    g = files(v2.prefix + "canary", size, byte=CANARY)
    table = [{"kind": "shm", "name": g, "offset": 4096, "size": 2 * n}]
    r = v2.call("compress", handles=table, tensors=[{"tensor": {**bf16_tensor(g, n), "data": {"kind": "ref", "index": 0, "offset": 2, "size": 2 * n}},
                                                     "out": out(g, o, cap)}])
    assert_error(r, "TZIP_HANDLE", contains="beyond its")
    # Served: the frame lands inside its region, every other byte of the file is as it was.
    r = c.call("compress", tensors=[{"tensor": bf16_tensor(f, n, offset=4096), "out": out(f, o, cap)}])
    assert r["ok"], r
    fb = r["frames"][0]["bytes"]
    after = read(f)
    assert after[:o] == before[:o] and after[o + fb:] == before[o + fb:]
    # Decompress writes exactly the tensor's bytes at its place.
    d = 32768
    r = c.call("decompress", frames=[{"frame": out(f, o, fb), "out": bf16_tensor(f, n, offset=d)}])
    assert r["ok"], r
    final = read(f)
    assert final[d:d + 2 * n] == data
    assert final[:d] == after[:d] and final[d + 2 * n:] == after[d + 2 * n:]
    # A destination region too small for the frame's tensor is refused, nothing written.
    r = c.call("decompress", frames=[{"frame": out(f, o, fb), "out": {**bf16_tensor(f, n, offset=d), "data": out(f, d, 2 * n - 2)}}])
    assert_error(r, "TZIP_HANDLE")
    assert read(f) == final


# --- sizes checked before allocation -----------------------------------------------------------------------------

def _zmtp_connect(path: str) -> socket.socket:
    """A raw ZMTP 3.0 DEALER connection (NULL mechanism) to the daemon, past the handshake."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\0" + b"\0" * 31)
    got = b""
    while len(got) < 64:
        b = s.recv(64 - len(got))
        assert b, "daemon closed during the greeting"
        got += b
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def _closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            b = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True
        if not b:
            return True
    return False


def test_transport_frame_claiming_2_to_the_60_bytes_is_dropped_unread(shared_daemon):
    """ZeroMQ's ZMQ_MAXMSGSIZE (transportMaxMessageBytes): a peer announcing a 2^60-byte message is disconnected at
    the frame header, before a byte of it is buffered; the daemon serves on, its memory unchanged."""
    rss = vm_rss_bytes(shared_daemon.pid)
    s = _zmtp_connect(shared_daemon.socket)
    try:
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 60) + b"x" * 4096)  # LONG message frame, 2^60 bytes announced
        assert _closed_by_peer(s)
    finally:
        s.close()
    c = RawConn(shared_daemon.socket)
    try:
        assert c.hello()["ok"] and c.alive()
    finally:
        c.close()
    assert vm_rss_bytes(shared_daemon.pid) < rss + (64 << 20)


def test_messagepack_lengths_claiming_billions_are_errors(conns):
    c = conns()
    head = msgpack.packb({"id": 7, "op": "compress", "sid": c.sid}, use_bin_type=True)
    # The map again with one more key, "tensors", whose array32 header claims 10^9 entries that never come.
    body = bytes([0x84]) + head[1:] + msgpack.packb("tensors") + b"\xdd" + struct.pack(">I", 10 ** 9)
    for msg in (body, b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff" + b"x", b"\x91" * 100_000):
        r = c.send_raw(msg)
        assert r["ok"] is False and r["error"]["code"] == "TZIP_PROTOCOL", r
    assert c.alive()


def _frame_header(nbytes: int, n_chunks: int, shape: tuple[int, ...], dtype: str = "U8") -> bytes:
    head = bytearray(_frame._align16(48 + 8 * len(shape)))
    _frame._HEADER.pack_into(head, 0, _frame.MAGIC, _frame.FORMAT_VERSION, _frame.DTYPE_CODES[dtype], 0, len(shape), 0, 0,
                             65536, nbytes, nbytes, n_chunks, 0, 0, 0)
    struct.pack_into(f"<{len(shape)}Q", head, 48, *shape)
    struct.pack_into("<I", head, 40, xxh32(bytes(head)))
    return bytes(head)


HUGE_HEADERS = [
    ("2^60 bytes", _frame_header(1 << 60, 2 ** 32 - 1, (1 << 60,))),
    ("2^32-1 chunks (a 64 GiB table)", _frame_header((2 ** 32 - 1) * 65536, 2 ** 32 - 1, ((2 ** 32 - 1) * 65536,))),
    ("shape product wrapping 2^64", _frame_header(0, 0, (2 ** 32, 2 ** 32))),
]


@pytest.mark.parametrize("what,header", HUGE_HEADERS, ids=[h[0] for h in HUGE_HEADERS])
def test_frame_headers_claiming_huge_sizes(conns, files, shared_daemon, what, header):
    c = conns()
    name = files(c.prefix + "hdr", 8192, header)
    rss = vm_rss_bytes(shared_daemon.pid)
    r = c.call("decompress", frames=[{"frame": out(name, 0, len(header)), "out": tensor(name, shape=(16,), code=1, bits=8, offset=4096)}])
    assert r["ok"] is False and r["error"]["code"] in ("TZIP_CORRUPT", "TZIP_TRUNCATED", "TZIP_INVALID_ARGUMENT"), r
    assert c.alive()
    assert vm_rss_bytes(shared_daemon.pid) < rss + (64 << 20)
    # The Python reader of the same bytes: an error, nothing allocated on the way.
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            _frame.read_header(header)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20)


def test_container_and_safetensors_sizes_are_checked_before_reading(tmp_path):
    # A .tzip whose trailer claims 10^9 index entries (32 GB of index) in a file of a few hundred bytes.
    st_header = b"{}" + b" " * 6
    original = 8 + len(st_header)
    prefix = _container._PREFIX.pack(_container.MAGIC, _container.CONTAINER_VERSION, 0, 0, original)
    body = prefix + struct.pack("<Q", len(st_header)) + st_header
    body += b"\0" * (-len(body) % 16)
    trailer = _container._TRAILER.pack(len(body), 10 ** 9, 0, original, _container.TRAILER_MAGIC, 0)
    path = tmp_path / "huge-index.tzip"
    path.write_bytes(body + trailer)
    tracemalloc.start()
    try:
        with pytest.raises(_container.ContainerError) as e:
            _container.ContainerReader(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.code == "TZIP_CORRUPT" and peak < (1 << 20)
    # A safetensors header whose shape's product is 2^124 elements over 2 bytes of data, and one claiming a 2^63-byte
    # header: errors or a plain description, never an allocation of their size.
    import json
    text = json.dumps({"w": {"dtype": "BF16", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 2]}}).encode()
    blob = struct.pack("<Q", len(text)) + text + b"\0\0"
    tracemalloc.start()
    try:
        try:
            h = _container.parse_safetensors_header(blob, len(blob), "w.safetensors")
            assert h.tensors[0].end - h.tensors[0].begin == 2
        except _container.ContainerError:
            pass
        with pytest.raises(_container.ContainerError):
            _container.parse_header_length(struct.pack("<Q", 2 ** 63), 100, "x.safetensors")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20)


def test_safetensors_headers_are_read_as_the_typescript_reader_reads_them():
    # The rules both readers share (docs/container.md, "The safetensors input"): a byte-order mark, a name with a lone
    # surrogate and a __metadata__ value that is not a string are refused; a surrogate pair is a name like any other.
    # The CLI used to accept all three, writing .tzip files this reader could not open.
    t = '"t": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}'

    def parse(text: bytes):
        blob = struct.pack("<Q", len(text)) + text
        return _container.parse_safetensors_header(blob, len(blob), "x.safetensors")

    assert len(parse(("{" + t + "}").encode()).tensors) == 1
    with pytest.raises(_container.ContainerError, match="not UTF-8 JSON"):
        parse(b"\xef\xbb\xbf{" + t.encode() + b"}")
    with pytest.raises(_container.ContainerError, match="lone UTF-16 surrogate"):
        parse(b'{"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}')
    assert parse(b'{"\\ud83d\\ude00": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}').tensors[0].name == "\U0001F600"
    def nested(levels: int) -> bytes:
        inner = "[" * (levels - 2) + "]" * (levels - 2)
        return ('{"n": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": ' + inner + "}}").encode()

    assert len(parse(nested(128)).tensors) == 1
    with pytest.raises(_container.ContainerError, match="nested 129 levels deep"):
        parse(nested(129))
    with pytest.raises(_container.ContainerError, match="more than 128"):
        parse(nested(100_000))
    for meta in (b'{"a": {"b": "c"}}', b'{"a": 1}', b'{"a": null}', b'{"\\udc00": "x"}', b'{"a": "\\ud800"}'):
        with pytest.raises(_container.ContainerError, match="__metadata__"):
            parse(b'{"__metadata__": ' + meta + b", " + t.encode() + b"}")


def test_the_daemon_served_on(shared_daemon):
    assert shared_daemon.alive()
    c = RawConn(shared_daemon.socket)
    try:
        assert c.hello()["ok"]
        s = c.req({"id": 1, "op": "stats"})
        assert s["ok"] and s["errors"].get("TZIP_INTERNAL", 0) == 0, s
    finally:
        c.close()
    # A real round trip through the client, bit-exact.
    with tzip.connect(shared_daemon.socket, spawn=False, strict=True) as client:
        t = torch.randn(4096).to(torch.bfloat16)
        (ct,) = client.compress([t])
        (back,) = client.decompress([ct])
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))
