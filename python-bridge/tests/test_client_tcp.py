"""The daemon's optional TCP endpoint (`tzip serve --tcp PORT`): tcp://127.0.0.1 only, CURVE only, clients admitted
by their public key (docs/protocol.md, "TCP"). A real daemon, real pyzmq CURVE sockets.
"""

from __future__ import annotations

import json
import os
import re

import msgpack
import pytest
import torch
import zmq

import tzip
from tzip._errors import DaemonUnavailableError

from test_client_support import DaemonProcess, sock_dir, wait_for  # noqa: F401


def tcp_endpoint(d: DaemonProcess) -> str:
    line = d.ready_line()
    assert line is not None and line.startswith("{"), d.read_log()
    return json.loads(line)["tcp"]


@pytest.fixture
def tcp_daemon(sock_dir):
    sock = os.path.join(sock_dir, "s", "tzip.sock")
    curve = os.path.join(sock_dir, "s", "curve")
    # One more client key pair, admitted through authorized_keys (written before the daemon starts).
    os.mkdir(os.path.dirname(sock), 0o700)  # the daemon refuses a socket folder open to others (it never chmods one)
    os.mkdir(curve, 0o700)
    extra_public, extra_secret = zmq.curve_keypair()
    with open(os.path.join(curve, "authorized_keys"), "wb") as f:
        f.write(b"# a second client\n" + extra_public + b"\n")
    d = DaemonProcess(sock, "--tcp", "0", "--json").start()
    d.curve_dir = curve
    d.extra = (extra_public, extra_secret)
    d.endpoint = tcp_endpoint(d)
    yield d
    d.stop()


def read_key(d: DaemonProcess, name: str) -> bytes:
    with open(os.path.join(d.curve_dir, name), "rb") as f:
        return f.read().strip()


def raw_stats(endpoint: str, curve: tuple[bytes, bytes, bytes] | None, timeout_ms: int = 1500) -> dict | None:
    """A `stats` request on a fresh DEALER (CURVE keys: server public, client public, client secret); None when
    no reply comes within the timeout."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = timeout_ms
    if curve is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
    s.connect(endpoint)
    try:
        s.send(msgpack.packb({"id": 7, "op": "stats"}))
        return msgpack.unpackb(s.recv())
    except zmq.Again:
        return None
    finally:
        s.close()


def test_keys_are_private_files(tcp_daemon):
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", tcp_daemon.endpoint)
    assert os.stat(tcp_daemon.curve_dir).st_mode & 0o777 == 0o700
    for name in ("server.public", "server.secret", "client.public", "client.secret"):
        st = os.stat(os.path.join(tcp_daemon.curve_dir, name))
        assert st.st_mode & 0o777 == 0o600
        assert len(read_key(tcp_daemon, name)) == 40


def test_round_trips_bit_exact_over_tcp_with_curve(tcp_daemon):
    c = tzip.connect(tcp_daemon.endpoint, strict=True, curve_dir=tcp_daemon.curve_dir)
    try:
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(50_000, generator=g).to(torch.bfloat16), torch.randn(3, 777, generator=g),
              torch.randint(-1000, 1000, (4096,), dtype=torch.int32, generator=g)]
        cts = c.compress(xs)
        ys = c.decompress(cts)
        assert cts[0].codec in ("fast", "max") and cts[0].ratio < 0.9  # coded by the daemon (strict: no raw fallback)
        for x, y in zip(xs, ys):
            assert y.dtype == x.dtype and y.shape == x.shape
            assert y.contiguous().view(torch.uint8).numpy().tobytes() == x.contiguous().view(torch.uint8).numpy().tobytes()
        assert c.connected and c.daemon_info["pid"] == tcp_daemon.pid
    finally:
        c.close()


def test_a_key_in_authorized_keys_is_admitted(tcp_daemon):
    pub, sec = tcp_daemon.extra
    reply = raw_stats(tcp_daemon.endpoint, (read_key(tcp_daemon, "server.public"), pub, sec))
    assert reply is not None and reply["ok"]


def test_unknown_keys_and_plain_tcp_get_nothing_and_the_daemon_serves_on(tcp_daemon):
    server = read_key(tcp_daemon, "server.public")
    pub, sec = zmq.curve_keypair()
    assert raw_stats(tcp_daemon.endpoint, (server, pub, sec)) is None  # refused by the ZAP handler
    assert wait_for(lambda: "client key not authorized" in tcp_daemon.read_log(), 5)
    assert raw_stats(tcp_daemon.endpoint, None) is None  # no CURVE at all: no handshake
    # A client that knows only the server key but signs with the server's own pair is no client either.
    assert raw_stats(tcp_daemon.endpoint, (server, server, read_key(tcp_daemon, "server.secret"))) is None
    good = (server, read_key(tcp_daemon, "client.public"), read_key(tcp_daemon, "client.secret"))
    reply = raw_stats(tcp_daemon.endpoint, good)
    assert reply is not None and reply["ok"] and tcp_daemon.alive()


def test_tcp_endpoints_are_loopback_only_and_need_keys(tmp_path):
    with pytest.raises(ValueError, match="127.0.0.1"):
        tzip.connect("tcp://10.0.0.1:5555", strict=True)
    with pytest.raises(DaemonUnavailableError, match="CURVE keys"):
        tzip.connect("tcp://127.0.0.1:5555", strict=True, curve_dir=str(tmp_path / "none"))


def test_tzip_socket_as_the_tcp_endpoint_finds_the_keys_next_to_the_default_ipc_socket(sock_dir, monkeypatch):
    """TZIP_SOCKET=tcp://127.0.0.1:PORT and no curve_dir: the keys are read from curve/ next to the default ipc socket
    ($XDG_RUNTIME_DIR/tzip/), where that daemon wrote them, not from a folder named after "tcp:"."""
    runtime = os.path.join(sock_dir, "run")
    os.makedirs(runtime, mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    monkeypatch.delenv("TZIP_CURVE_DIR", raising=False)
    d = DaemonProcess(os.path.join(runtime, "tzip", "tzip.sock"), "--tcp", "0", "--json").start()
    try:
        monkeypatch.setenv("TZIP_SOCKET", tcp_endpoint(d))
        c = tzip.connect(spawn=False, strict=True)
        try:
            x = torch.arange(4096, dtype=torch.int32).view(torch.float32)
            assert torch.equal(c.decompress(c.compress(x)).view(torch.int32), x.view(torch.int32))
        finally:
            c.close()
    finally:
        d.stop()
