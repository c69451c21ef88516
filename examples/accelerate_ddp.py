"""Accelerate without Trainer: register tzip's lossless comm hook on the model ``accelerator.prepare`` returns.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py                 # 2 gloo ranks, CPU
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --accumulation 2 --steps 6

With more than one process ``accelerator.prepare(model, ...)`` returns a ``DistributedDataParallel``; tzip's hook
goes on it once, before the first backward, as on any DDP model::

    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    state = tzip.ddp.LosslessState(codec="auto")           # or: tzip.attach(model=model, codec="auto")
    model.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    ...                                                    # the loop as before: accumulate, backward, step
    print(state.bytes_sent / state.bytes_raw)

(Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its built-in hooks, and DDP takes one
hook per model: leave it unset.) ``accelerator.accumulate(model)`` skips the all-reduce of the micro-batches between
optimizer steps with DDP's ``no_sync``, which the hook follows.

The run is made twice from the same weights, data and seeds, plain Accelerate and with the hook: the bundled
all-MiniLM-L6-v2 as a sentence-pair classifier (examples/trainer_callback.py's ``build_model`` / ``build_dataset``),
AdamW, a linear LR schedule, dropout on. Every micro-batch's loss is compared by its float bits and the final
parameters of every rank by their bytes (sha256); the exit code is 1 when they differ (2 ranks: a sum of two does not
depend on the order; with more, compare with ``--codec raw``). ``--json`` prints rank 0's summary as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # trainer_callback.py, beside this file

import torch  # noqa: E402

from trainer_callback import build_dataset, build_model, params_sha256  # noqa: E402


def train(use_tzip: bool, args) -> dict:
    """One Accelerate training run; returns the losses' bits, the parameters' sha256 and the hook's figures."""
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    import tzip.ddp

    torch.use_deterministic_algorithms(True)
    accelerator = Accelerator(cpu=args.device == "cpu", gradient_accumulation_steps=args.accumulation)
    model = build_model(args.layers)
    torch.manual_seed(1234 + accelerator.process_index)  # dropout masks: the same in both runs
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=args.steps)
    dl = torch.utils.data.DataLoader(build_dataset(), batch_size=args.batch, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    state = None
    if use_tzip:
        if not isinstance(model, DistributedDataParallel):
            sys.exit("one process: no DistributedDataParallel, nothing to all-reduce (launch with torchrun)")
        state = tzip.ddp.LosslessState(codec=args.codec)
        model.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    losses = []
    micro = 0
    while micro < args.steps * args.accumulation:
        for batch in dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(f"{struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}")
            micro += 1
            if micro == args.steps * args.accumulation:
                break
    out = {"losses": losses, "params": params_sha256(accelerator.unwrap_model(model)),
           "ddp": type(model).__name__}
    if state is not None:
        out.update(bytes_raw=state.bytes_raw, bytes_sent=state.bytes_sent, buckets=state.buckets)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps")
    ap.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--layers", type=int, default=6, help="trained transformer layers kept (1-6)")
    ap.add_argument("--batch", type=int, default=4, help="examples per rank and micro-batch")
    ap.add_argument("--codec", choices=["auto", "fast", "max", "raw"], default="auto")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true", help="print rank 0's summary as one JSON line")
    args = ap.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        ap.error("launch it on 2 or more processes: torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py")
    plain = train(False, args)
    tz = train(True, args)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": dist.get_rank(), "plain": plain, "tzip": tz})
    same = all(r["plain"]["losses"] == r["tzip"]["losses"] and r["plain"]["params"] == r["tzip"]["params"]
               for r in ranks)
    if dist.get_rank() == 0:
        t = ranks[0]["tzip"]
        summary = {"ranks": len(ranks), "codec": args.codec, "ddp": t["ddp"], "micro_batches": len(t["losses"]),
                   "loss_bits": {"plain": ranks[0]["plain"]["losses"], "tzip": t["losses"]},
                   "params_sha256": {r["rank"]: {"plain": r["plain"]["params"], "tzip": r["tzip"]["params"]}
                                     for r in ranks},
                   "bytes_raw": t["bytes_raw"], "bytes_sent": t["bytes_sent"], "buckets": t["buckets"],
                   "identical": same}
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"Accelerate + tzip's DDP comm hook (codec {args.codec}): {len(ranks)} ranks, {args.steps} optimizer "
                  f"steps of {args.accumulation} micro-batches, model {t['ddp']}")
            for i, (pb, tb) in enumerate(zip(ranks[0]["plain"]["losses"], t["losses"])):
                print(f"micro-batch {i + 1:>2}: loss bits {pb} (plain) {'same' if tb == pb else tb} (tzip)")
            for r in ranks:
                print(f"rank {r['rank']}: final parameters sha256 {r['plain']['params'][:16]} (plain), "
                      f"{'same' if r['tzip']['params'] == r['plain']['params'] else r['tzip']['params'][:16]} (tzip)")
            print(f"rank 0 gradients: {t['bytes_raw'] / 1e6:.2f} MB plain DDP would send, {t['bytes_sent'] / 1e6:.2f} MB "
                  f"sent ({t['bytes_sent'] / max(1, t['bytes_raw']):.4f}), {t['buckets']} buckets")
            print("bit-identical (losses by their float bits, parameters by their bytes, every rank): "
                  + ("yes" if same else "NO"))
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
