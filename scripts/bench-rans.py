"""CPU `max` (rANS) decode speed, one thread, of the bundled bf16/fp32 weights and gradients, with the AVX2 lane steps
and with the scalar loop (TZIP_RANS_SCALAR=1, in a child process: the choice is made once per process).

    .venv/bin/python scripts/bench-rans.py        # after npm test's set-up (data/demo, build/Release/libtzip.so)

Per file: all its floating tensors concatenated, coded with `max` (64 KiB chunks, one thread), decoded 5 times into
one buffer (tzip._native.cpu_decode, digests checked), the best time; the decoded bytes compared with the input.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python-bridge"))
FILES = ["minilm-grads-bf16", "minilm-weights-bf16", "minilm-grads-f32"]


def measure() -> None:
    import torch
    from safetensors.torch import load_file
    from tzip import _native
    for name in FILES:
        sd = load_file(ROOT / "data" / "demo" / f"{name}.safetensors")
        t = torch.cat([v.reshape(-1) for v in sd.values() if v.is_floating_point()])
        frame = _native.cpu_encode(t, "max", 65536, 1)
        out = torch.empty_like(t)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            _native.cpu_decode(frame, out, True, 1)
            best = min(best, time.perf_counter() - t0)
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8)), name
        print(f"  {name}: ratio {frame.numel() / (t.numel() * t.element_size()):.4f}, max decode "
              f"{t.numel() * t.element_size() / best / 1e9:.2f} GB/s (1 thread)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        measure()
        sys.exit(0)
    for label, extra in (("AVX2 lane steps (where the CPU has AVX2)", {}), ("scalar loop (TZIP_RANS_SCALAR=1)", {"TZIP_RANS_SCALAR": "1"})):
        print(label, flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TZIP_RANS_SCALAR"} | extra
        subprocess.run([sys.executable, __file__, "--child"], env=env, check=True)
