"""Where a generated token's host time goes: plain bf16 against tzip ``fast`` kept compressed, batch 1, on a GPU host.

    python3 scripts/profile-inference.py        # from the repository root, after scripts/gpu-inference.sh's set-up

The model of ``python -m tzip.bench.inference`` (22 layers, hidden 2048, weights tiled from the bundled MiniLM's bf16
matrices); greedy ``generate()`` of 64 tokens after a 512-token prompt, the best of 3 timed calls, then one call under
cProfile, whose 18 most expensive functions (own time) are printed. Figures: docs/benchmarks.md, inference section.
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python-bridge"))
from tzip.bench.inference import build_model  # noqa: E402
from tzip.inference import compress_model  # noqa: E402

TOKENS = 64


def profile(model, ids, tag: str) -> None:
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=TOKENS, min_new_tokens=TOKENS)
    with torch.no_grad():
        model.generate(ids, **kw)  # warm-up of this shape
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        pr = cProfile.Profile()
        pr.enable()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        pr.disable()
    best = min(times)
    print(f"== {tag}: {TOKENS / best:.1f} tok/s ({best / TOKENS * 1e3:.2f} ms/token)")
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())


def main() -> int:
    if not torch.cuda.is_available():
        print("profile-inference: no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    model, cfg = build_model(Path("data/demo/minilm-weights-bf16.safetensors"), 22, 2048, dev)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0)).to(dev)
    profile(model, ids, "bf16")
    compress_model(model, codec="fast")
    profile(model, ids, "tzip fast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
