"""Daemon endpoints in every spelling users write (issue 14, item 8): ``ipc:///abs/path``, ``tcp://127.0.0.1:PORT``
and plain paths, through ``tzip._spawn.normalize_endpoint``, ``$TZIP_SOCKET`` and the transport, the last one against
a real daemon."""

from __future__ import annotations

import os

import pytest

from tzip._spawn import MAX_SOCKET_PATH_BYTES, default_ipc_path, default_socket_path, normalize_endpoint
from tzip._transport import Transport

from test_client_support import daemon, sock_dir  # noqa: F401


@pytest.mark.parametrize("spelling, path", [
    ("ipc:///tmp/tzip-x/tzip.sock", "/tmp/tzip-x/tzip.sock"),
    ("IPC:///tmp/tzip-x/tzip.sock", "/tmp/tzip-x/tzip.sock"),  # URL schemes are case-insensitive
    ("ipc:///tmp//tzip-x/./a/../tzip.sock", "/tmp/tzip-x/tzip.sock"),
    ("ipc:////tmp/tzip-x/tzip.sock", "/tmp/tzip-x/tzip.sock"),
    ("/tmp/tzip-x/tzip.sock", "/tmp/tzip-x/tzip.sock"),
])
def test_ipc_and_absolute_spellings_name_the_socket_file(spelling, path):
    assert normalize_endpoint(spelling) == path


def test_a_plain_relative_path_is_made_absolute_against_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_endpoint("s/tzip.sock") == str(tmp_path / "s" / "tzip.sock")
    # The old bug (issue 14): `ipc:/x` has no `//`, so it is a plain relative path, kept as the user wrote it.
    assert normalize_endpoint("ipc:/x.sock") == str(tmp_path / "ipc:" / "x.sock")


@pytest.mark.parametrize("spelling, normal", [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1:1", "tcp://127.0.0.1:1"),
    ("tcp://127.0.0.1:65535", "tcp://127.0.0.1:65535"),
    ("tcp://127.0.0.1:08080", "tcp://127.0.0.1:8080"),
])
def test_the_loopback_tcp_endpoint_is_kept(spelling, normal):
    assert normalize_endpoint(spelling) == normal


@pytest.mark.parametrize("spelling, says", [
    ("", "empty tzip endpoint"),
    ("ipc://tmp/x.sock", "three slashes"),
    ("ipc://@abstract", "absolute path"),
    ("ipc://", "absolute path"),
    ("tcp://0.0.0.0:5555", "tcp://127.0.0.1:PORT"),
    ("tcp://localhost:5555", "tcp://127.0.0.1:PORT"),
    ("tcp://[::1]:5555", "tcp://127.0.0.1:PORT"),
    ("tcp://127.0.0.1", "tcp://127.0.0.1:PORT"),
    ("tcp://127.0.0.1:0", "PORT 1..65535"),
    ("tcp://127.0.0.1:65536", "PORT 1..65535"),
    ("tcp://127.0.0.1:*", "PORT 1..65535"),
    ("inproc://tzip", "unsupported endpoint scheme inproc://"),
    ("udp://127.0.0.1:5555", "unsupported endpoint scheme udp://"),
    ("http://127.0.0.1:5555", "unsupported endpoint scheme http://"),
])
def test_other_spellings_are_refused_with_a_clear_message(spelling, says):
    with pytest.raises(ValueError) as e:
        normalize_endpoint(spelling)
    assert says in str(e.value)
    if spelling:
        assert repr(spelling) in str(e.value)  # the message names what the user wrote


def test_a_path_longer_than_unix_sockets_allow_is_refused():
    ok = "/" + "a" * (MAX_SOCKET_PATH_BYTES - 1)
    assert normalize_endpoint(ok) == ok
    with pytest.raises(ValueError, match="at most 107"):
        normalize_endpoint(ok + "a")
    with pytest.raises(ValueError, match="at most 107"):
        normalize_endpoint("ipc://" + ok + "a")


def test_a_non_string_is_refused():
    with pytest.raises(ValueError, match="is a str"):
        normalize_endpoint(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("value, expected", [
    ("ipc:///tmp/tzip-env/tzip.sock", "/tmp/tzip-env/tzip.sock"),
    ("/tmp/tzip-env/tzip.sock", "/tmp/tzip-env/tzip.sock"),
    ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7000"),
])
def test_tzip_socket_accepts_every_spelling(value, expected, monkeypatch):
    monkeypatch.setenv("TZIP_SOCKET", value)
    assert default_socket_path() == expected


def test_tzip_socket_relative_and_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TZIP_SOCKET", "rel.sock")
    assert default_socket_path() == str(tmp_path / "rel.sock")
    monkeypatch.delenv("TZIP_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == default_ipc_path() == str(tmp_path / "tzip" / "tzip.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/run")  # not absolute: ignored, as the daemon does
    assert default_socket_path() == f"/tmp/tzip-{os.getuid()}/tzip.sock"


def test_a_bad_tzip_socket_names_the_variable(monkeypatch):
    monkeypatch.setenv("TZIP_SOCKET", "ipc://tmp/x.sock")
    with pytest.raises(ValueError, match=r"^TZIP_SOCKET: 'ipc://tmp/x.sock': .*three slashes"):
        default_socket_path()


@pytest.mark.parametrize("spelling, endpoint", [
    ("ipc:///tmp/tzip-t/tzip.sock", "ipc:///tmp/tzip-t/tzip.sock"),
    ("/tmp/tzip-t/tzip.sock", "ipc:///tmp/tzip-t/tzip.sock"),
    ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7001"),
])
def test_the_transport_connects_to_the_normalized_endpoint(spelling, endpoint):
    t = Transport(spelling)
    try:
        assert t.endpoint == endpoint
    finally:
        t.close()


def test_the_transport_refuses_a_bad_spelling():
    with pytest.raises(ValueError, match="three slashes"):
        Transport("ipc://tmp/x.sock")


def test_a_real_daemon_answers_on_every_ipc_spelling(daemon, monkeypatch):  # noqa: F811
    """The same daemon is reached as ipc:///abs, as the absolute path, and as a path relative to the current folder:
    each hello is answered with that daemon's pid and a session of its own."""
    sock = daemon.socket
    monkeypatch.chdir(os.path.dirname(sock))
    sids = set()
    for spelling in (f"ipc://{sock}", sock, os.path.basename(sock)):
        t = Transport(spelling)
        try:
            hello = {"op": "hello", "versions": [1], "pid": os.getpid(), "shm_prefix": f"tzip-{os.getpid()}-0123abcd-"}
            reply = t.request(hello, alive=lambda: True, timeout=10)
            assert reply.get("ok") is True, reply
            assert reply["daemon"]["pid"] == daemon.pid
            sids.add(reply["sid"])
            bye = t.request({"op": "release", "sid": reply["sid"], "end": True}, alive=lambda: True, timeout=10)
            assert bye.get("ok") is True, bye
        finally:
            t.close()
    assert len(sids) == 3


@pytest.mark.parametrize("how", ["argument", "TZIP_SOCKET"])
def test_connect_takes_the_ipc_spelling(daemon, monkeypatch, how):  # noqa: F811
    """tzip.connect("ipc:///abs") and TZIP_SOCKET=ipc:///abs reach the daemon at /abs: a bit-exact round trip."""
    import torch
    import tzip

    spelling = f"ipc://{daemon.socket}"
    if how == "TZIP_SOCKET":
        monkeypatch.setenv("TZIP_SOCKET", spelling)
        c = tzip.connect(spawn=False, strict=True)
    else:
        monkeypatch.delenv("TZIP_SOCKET", raising=False)
        c = tzip.connect(spelling, spawn=False, strict=True)
    try:
        assert c.socket_path == daemon.socket and c.daemon_info["pid"] == daemon.pid
        t = torch.randn(4096, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
        back = c.decompress(c.compress(t))
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))
    finally:
        c.close()


def test_connect_refuses_a_bad_spelling_before_anything_starts(monkeypatch, tmp_path):
    import tzip

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="three slashes"):
        tzip.connect("ipc://tzip-nowhere/tzip.sock", spawn=True)
    assert not (tmp_path / "tzip-nowhere").exists()  # no daemon was started on a relative guess
