"""What a new user runs into with the README and docs/install.md in hand, kept as tests once found.

A socket whose folder cannot be created (a typo that puts it under a regular file; a path like the docs'
``/run/user/1000/tzip/tzip.sock`` on a machine where the user may not create ``/run/user/1000``) is a daemon that
cannot be started: like every other failed start (no CLI, the daemon exits at once) the client stores tensors
uncompressed and warns once, and ``strict=True`` raises DaemonUnavailableError (README, "From PyTorch"). It used to
raise the OSError of ``mkdir`` (FileExistsError, NotADirectoryError, PermissionError) out of ``tzip.connect()`` and
out of every integration that uses the default client (``tzip.save`` included).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import tzip
from tzip.client import DaemonUnavailableError

from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)


@pytest.fixture
def socket_under_a_file(tmp_path, monkeypatch):
    """A socket path whose folder's parent is a regular file, and no CLI to start a daemon with (so that nothing is
    started even if the folder could be made)."""
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    monkeypatch.setenv("TZIP_CLI", str(tmp_path / "no-cli.js"))
    return str(tmp_path / "notes.txt" / "tzip" / "tzip.sock")


def test_connect_to_a_socket_whose_folder_cannot_be_made_falls_back_to_raw_and_warns_once(socket_under_a_file):
    t = torch.randn(3000, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tzip.connect(socket_under_a_file)
        cts = c.compress([t, t[:100]])
        c.compress(t)
    try:
        ours = [w for w in caught if "tzip" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert "notes.txt" in str(ours[0].message)  # says which folder could not be made
        assert [ct.codec for ct in cts] == ["raw", "raw"]
        back = c.decompress(cts)  # raw frames decode without a daemon
        assert back[0].view(torch.int16).numpy().tobytes() == t.view(torch.int16).numpy().tobytes()
        assert back[1].view(torch.int16).numpy().tobytes() == t[:100].view(torch.int16).numpy().tobytes()
    finally:
        c.close()


def test_strict_connect_to_a_socket_whose_folder_cannot_be_made_raises_daemon_unavailable(socket_under_a_file):
    with pytest.raises(DaemonUnavailableError, match="notes.txt"):
        tzip.connect(socket_under_a_file, strict=True)


def test_a_json_file_given_as_safetensors_is_called_not_a_safetensors_file(tmp_path):
    """A model folder's config.json given where a safetensors file goes (tzip.files.compress_file, as `tzip compress
    config.json` in the CLI): the error says it is not a safetensors file and shows the text it starts with. It used
    to say only "safetensors header length 7234013700659612283 exceeds the 100000000-byte limit". The code stays
    TZIP_CORRUPT (the CLI's exit code 2), as the TypeScript reader's (test/cli.test.ts)."""
    import json

    from tzip import _container, files

    src = tmp_path / "config.json"
    src.write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 384}, indent=2))
    with pytest.raises(_container.ContainerError) as e:
        files.compress_file(src, tmp_path / "config.tzip")
    assert e.value.code == "TZIP_CORRUPT"
    assert 'not a safetensors file: it starts with text ("{\\n  \\"arc")' in str(e.value), str(e.value)
    assert str(src) in str(e.value)
    assert not (tmp_path / "config.tzip").exists()
    # a binary length that is merely absurd is not called text
    with pytest.raises(_container.ContainerError) as e:
        _container.parse_header_length((2 ** 63).to_bytes(8, "little"), 100, "x.safetensors")
    assert e.value.code == "TZIP_CORRUPT" and "not a safetensors file" not in str(e.value)


def test_an_empty_tensor_has_no_ratio_rather_than_nan(daemon):
    """CompressedTensor.ratio of an empty tensor is None (the CLI's --json null, its tables' "-"), and its repr says
    ``ratio=-``: it used to be NaN, printed ``ratio=nan``. The tensor still comes back as it went."""
    with tzip.connect(daemon.socket, spawn=False) as c:
        empty, full = c.compress([torch.empty(0, 4, dtype=torch.bfloat16), torch.ones(512, dtype=torch.bfloat16)])
        assert empty.nbytes == 0 and empty.ratio is None
        assert "ratio=-," in repr(empty) and "nan" not in repr(empty)
        assert isinstance(full.ratio, float) and full.ratio == full.compressed_nbytes / 1024
        back = c.decompress(empty)
        assert back.dtype == torch.bfloat16 and tuple(back.shape) == (0, 4)


@pytest.mark.parametrize("mode, chmod", [(0o755, True), (0o1777, False)])
def test_a_socket_folder_open_to_others_falls_back_with_the_fix_in_the_warning(tmp_path, monkeypatch, mode, chmod):
    """A socket in an existing folder of mode 755 (a `mkdir` with the usual umask): the daemon refuses such a folder,
    and the client falls back to raw frames with one warning that leads with the folder, its mode and the fix (a
    socket in a folder of its own, or `chmod 700 DIR`; never chmod for a folder others write in, such as a 1777 one).
    It used to give the fix only inside the daemon's log tail, and not at all where no CLI could be found (a pip
    install without Node: here $TZIP_CLI names no file). strict=True raises DaemonUnavailableError with the same
    words."""
    folder = tmp_path / "sockets"
    folder.mkdir()
    os.chmod(folder, mode)
    monkeypatch.setenv("TZIP_CLI", str(tmp_path / "no-cli.js"))
    socket = str(folder / "tzip.sock")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = tzip.connect(socket)
        try:
            assert c.compress(torch.ones(64)).codec == "raw"
        finally:
            c.close()
    ours = [str(w.message) for w in caught if "tzip" in str(w.message)]
    assert len(ours) == 1, ours
    assert f"the socket folder {folder} has mode {mode:o}, open to other users" in ours[0], ours[0]
    assert f"e.g. {folder / f'tzip-{os.getuid()}' / 'tzip.sock'}" in ours[0]
    assert (f"`chmod 700 {folder}`" in ours[0]) is chmod
    assert not (folder / "tzip.sock.log").exists()  # no daemon was started only to be refused
    with pytest.raises(DaemonUnavailableError, match="open to other users"):
        tzip.connect(socket, strict=True)
