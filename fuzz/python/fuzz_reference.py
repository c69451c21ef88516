"""atheris target: the reference decoder (python-bridge/tzip/reference.py, docs/format.md written as Python) and
the client's own frame reader (tzip/_frame.py) on hostile frames.

Properties: both refuse with ValueError only; a frame the reference decodes, re-encoded by the reference's canonical
encoder with the frame's codec and chunk size, decodes to the same bytes; the client's read_header accepts every
frame the reference accepts and reads the same fields; a raw frame the client's decode_raw accepts the reference
accepts too, with the same bytes (the client decodes raw frames itself when the daemon is away).
Usage: .venv/bin/python fuzz/python/fuzz_reference.py [libFuzzer flags] CORPUS... (scripts/fuzz.sh runs it).
"""

import sys

try:
    import atheris
except ImportError:  # python-bridge/tests/test_fuzz_regressions.py replays check() without atheris
    atheris = None

if atheris is not None and __name__ == "__main__":
    with atheris.instrument_imports(include=["tzip"]):
        from tzip import _frame, reference
else:
    from tzip import _frame, reference

import torch

MAX_REENCODE = 1 << 16  # the reference encoder is pure Python: bigger tensors only decode


def check(data: bytes) -> None:
    try:
        raw, info = reference.decode_frame(data)
    except ValueError:
        raw = info = None
    try:
        h = _frame.read_header(data)
    except ValueError:
        h = None
    if info is not None:
        assert h is not None, "the client's read_header refuses a frame the reference decodes"
        assert (h.dtype, h.codec, list(h.shape), h.nbytes, h.chunk_size, h.n_chunks, h.header_bytes, h.payload_bytes) == (
            info["dtype"], info["codec"], info["shape"], info["nbytes"], info["chunk_size"], info["n_chunks"],
            info["header_bytes"], info["payload_bytes"]), "read_header and the reference disagree"
        if len(raw) <= MAX_REENCODE:
            again = reference.encode_frame(raw, info["dtype"], info["shape"], info["codec"], info["chunk_size"])
            back, _ = reference.decode_frame(again)
            assert back == raw, "re-encoded frame decodes to other bytes"
    if h is not None and h.codec == "raw" and len(data) == h.frame_bytes:
        try:
            body = _frame.decode_raw(torch.frombuffer(bytearray(data), dtype=torch.uint8), h).numpy().tobytes()
        except ValueError:
            return
        assert info is not None, "the client's decode_raw accepts a raw frame the reference refuses"
        assert body == raw, "decode_raw and the reference decode different bytes"


def main() -> None:
    atheris.Setup(sys.argv, lambda data: check(bytes(data)))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
