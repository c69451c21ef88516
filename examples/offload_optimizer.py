"""Train the bundled all-MiniLM-L6-v2 on real text with its AdamW state offloaded compressed, next to plain AdamW.

    .venv/bin/python examples/offload_optimizer.py [--steps 6] [--device cpu|cuda] [--codec auto] [--socket PATH]

Both runs start from the same trained weights and see the same batches (consecutive sentence pairs of the model card,
the model's own contrastive objective, as tzip.demo_data's gradient pass); the loss of every step is printed with
its bit pattern, and the script exits 1 unless both runs agree bit for bit (losses, parameters, optimizer state).
It prints the state's bytes uncompressed and compressed (ratio), on a GPU how much memory the offload frees
(torch.cuda.memory_allocated after a step, plain minus offloaded), and the mean step time (optimizer step alone and
the whole training step, wall clock, first step left out) of both runs. The default run takes about a minute on
2 CPU cores. ``--socket``: a running daemon's socket; by default tzip.connect() finds or starts one.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time

# GPU kernels must be deterministic for two training runs to agree (cuBLAS needs this before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import tzip  # noqa: E402
from tzip import demo_data as dd  # noqa: E402
from tzip._dlpack import int_alias  # noqa: E402
from tzip.optim import CompressedOffload  # noqa: E402


def f32_bits(x: float) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(name: str, make_opt, args, data) -> dict:
    """One training run; returns losses, final parameters and state (bits), timings and memory figures."""
    model = dd.load_model().to(args.device)
    model.eval()  # dropout off (deterministic), autograd on
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=len(data))
    losses, step_s, train_s, after_step = [], [], [], []
    for batch in data:
        sync(args.device)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = dd.pair_loss(model, batch, args.device)
        loss.backward()
        sync(args.device)
        t1 = time.perf_counter()
        opt.step()
        sched.step()
        sync(args.device)
        t2 = time.perf_counter()
        losses.append(loss.item())
        step_s.append(t2 - t1)
        train_s.append(t2 - t0)
        if args.device == "cuda":
            after_step.append(torch.cuda.memory_allocated())
    out = {
        "name": name, "losses": losses, "step_s": step_s, "train_s": train_s, "after_step": after_step,
        "params": [int_alias(p.detach()).cpu().clone() for p in model.parameters()],
        "state": {i: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                  for i, st in opt.state_dict()["state"].items()},
        "stats": opt.offload_stats() if isinstance(opt, CompressedOffload) else None,
    }
    if args.device == "cuda":
        out["state_gpu_bytes"] = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor) and v.is_cuda)
    del model, opt, sched
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def same_state(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    for i in a:
        if list(a[i]) != list(b[i]):
            return False
        for k, v in a[i].items():
            w = b[i][k]
            if isinstance(v, torch.Tensor):
                if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape
                        and torch.equal(int_alias(v.detach().contiguous()).cpu(), int_alias(w.detach().contiguous()).cpu())):
                    return False
            elif v != w:
                return False
    return True


def mean_after_first(xs: list[float]) -> float:
    xs = xs[1:] if len(xs) > 1 else xs
    return sum(xs) / len(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=4, help="sentence pairs per step (batch of 2x this many sentences)")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--codec", default="auto", choices=list(tzip.client.CODECS))
    ap.add_argument("--socket", default=None, help="daemon socket (default: tzip.connect()'s)")
    args = ap.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    client = tzip.connect(args.socket) if args.socket else None  # None: the process-wide default client
    data = dd.pair_batches(args.steps, args.pairs, args.max_length)

    def adamw(params):
        return torch.optim.AdamW(params, lr=2e-5, weight_decay=0.01)

    plain = run("AdamW", adamw, args, data)
    off = run("CompressedOffload(AdamW)", lambda ps: CompressedOffload(adamw(ps), codec=args.codec, client=client), args, data)

    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"all-MiniLM-L6-v2, {args.steps} steps of {2 * args.pairs} sentences x {args.max_length} tokens, AdamW, "
          f"codec {args.codec!r}, on {machine}")
    print(f"{'step':>4}  {'loss AdamW':>24}  {'loss CompressedOffload':>24}  same bits")
    for i, (a, b) in enumerate(zip(plain["losses"], off["losses"])):
        print(f"{i:4d}  {a:13.9f} {f32_bits(a)}  {b:13.9f} {f32_bits(b)}  {'yes' if f32_bits(a) == f32_bits(b) else 'NO'}")
    s = off["stats"]
    print(f"optimizer state: {s['state_bytes'] / 1e6:.2f} MB uncompressed -> {s['compressed_bytes'] / 1e6:.2f} MB "
          f"compressed (ratio {s['ratio']:.4f}; {s['tensors']} tensors in {s['chunks']} frames, codecs {s['codecs']}), "
          f"{s['resident_bytes']} bytes kept as they are")
    if args.device == "cuda":
        freed = plain["after_step"][-1] - off["after_step"][-1]
        print(f"GPU memory after a step: AdamW {plain['after_step'][-1] / 1e6:.2f} MB, offloaded "
              f"{off['after_step'][-1] / 1e6:.2f} MB: {freed / 1e6:.2f} MB freed (AdamW's state on the GPU: "
              f"{plain['state_gpu_bytes'] / 1e6:.2f} MB); pinned host memory held: {s['pinned_bytes'] / 1e6:.2f} MB")
    else:
        print(f"host memory holding the frames: {s['host_bytes'] / 1e6:.2f} MB")
    for r in (plain, off):
        print(f"{r['name']:>26}: optimizer step {mean_after_first(r['step_s']) * 1e3:8.1f} ms, training step "
              f"{mean_after_first(r['train_s']) * 1e3:8.1f} ms (mean wall clock of steps 1..{args.steps - 1})")
    print(f"{'':>26}  last offload: restore {s['restore_s'] * 1e3:.1f} ms, offload {s['offload_s'] * 1e3:.1f} ms")

    ok_losses = [f32_bits(a) for a in plain["losses"]] == [f32_bits(b) for b in off["losses"]]
    ok_params = all(torch.equal(a, b) for a, b in zip(plain["params"], off["params"]))
    ok_state = same_state(plain["state"], off["state"])
    print(f"bit-identical: losses {'yes' if ok_losses else 'NO'}, parameters {'yes' if ok_params else 'NO'}, "
          f"optimizer state {'yes' if ok_state else 'NO'}")
    if client is not None:
        client.close()
    return 0 if ok_losses and ok_params and ok_state else 1


if __name__ == "__main__":
    sys.exit(main())
