"""atheris target: the client's .tzip container reader (python-bridge/tzip/_container.py: ContainerReader, which
tzip.load and DCP's reader use) on hostile files.

Properties: opening and reading refuse with ContainerError (a ValueError) only; every entry of a container that
opens reads (read_frame) or is refused the same way; a frame that reads decodes with the reference decoder
(tzip/reference.py) to exactly the entry's byte count, and its header matches the entry.
Usage: .venv/bin/python fuzz/python/fuzz_container.py [libFuzzer flags] CORPUS... (scripts/fuzz.sh runs it).
"""

import atexit
import os
import shutil
import sys
import tempfile

try:
    import atheris
except ImportError:  # python-bridge/tests/test_fuzz_regressions.py replays check() without atheris
    atheris = None

if atheris is not None and __name__ == "__main__":
    with atheris.instrument_imports(include=["tzip"]):
        from tzip import _container, reference
else:
    from tzip import _container, reference

MAX_DECODE = 1 << 18


def check(data: bytes, scratch: str | None = None) -> None:
    """Writes ``data`` to ``scratch``/in.tzip (default a folder made once, removed when the fuzzer exits) and reads it."""
    path = os.path.join(scratch or _scratch(), "in.tzip")
    with open(path, "wb") as f:
        f.write(data)
    try:
        reader = _container.ContainerReader(path)
    except _container.ContainerError:
        return
    with reader:
        for e in reader.entries:
            try:
                frame = reader.read_frame(e)
            except _container.ContainerError:
                return
            if e.frame_bytes > MAX_DECODE:
                continue
            try:
                raw, info = reference.decode_frame(frame.numpy().tobytes())
            except ValueError:
                continue  # a bad chunk: the daemon's decoder refuses it too
            assert len(raw) == e.end - e.begin, "a frame decodes to another size than its entry"
            assert (info["dtype"], tuple(info["shape"])) == (e.dtype, tuple(e.shape)), "frame differs from its entry"


_SCRATCH: list[str] = []


def _scratch() -> str:
    """$TZIP_FUZZ_SCRATCH (scripts/fuzz.sh: under build/fuzz, since libFuzzer ends the process without running
    atexit handlers), else a temporary folder removed at a normal exit."""
    if not _SCRATCH:
        fixed = os.environ.get("TZIP_FUZZ_SCRATCH")
        if fixed:
            os.makedirs(fixed, exist_ok=True)
            _SCRATCH.append(fixed)
        else:
            _SCRATCH.append(tempfile.mkdtemp(prefix="tzip-fuzz-py-"))
            atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return _SCRATCH[0]


def main() -> None:
    atheris.Setup(sys.argv, lambda data: check(bytes(data)))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
