"""atheris target: the client's .tzip container reader (python-bridge/tzip/_container.py: ContainerReader, which
tzip.load and DCP's reader use) on hostile files.

Properties: opening and reading refuse with ContainerError (a ValueError) only; every entry of a container that
opens reads (read_frame) or is refused the same way; a frame that reads decodes with the reference decoder
(tzip/reference.py) to exactly the entry's byte count, and its header matches the entry.
Usage: .venv/bin/python fuzz/python/fuzz_container.py [libFuzzer flags] CORPUS... (scripts/fuzz.sh runs it).
"""

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["tzip"]):
    from tzip import _container, reference

_DIR = tempfile.mkdtemp(prefix="tzip-fuzz-py-")
_PATH = os.path.join(_DIR, "in.tzip")
MAX_DECODE = 1 << 18


def check(data: bytes) -> None:
    with open(_PATH, "wb") as f:
        f.write(data)
    try:
        reader = _container.ContainerReader(_PATH)
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


def main() -> None:
    atheris.Setup(sys.argv, lambda data: check(bytes(data)))
    try:
        atheris.Fuzz()
    finally:
        import shutil
        shutil.rmtree(_DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
