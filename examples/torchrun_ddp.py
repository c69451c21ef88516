"""Plain PyTorch DDP under torchrun with tzip's lossless comm hook: the two lines a training script adds.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py               # 2 gloo ranks, CPU
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --device cuda # NCCL, a GPU per rank (not run yet)
    TZIP_ATTACH=1 TZIP_JOB=run1 .venv/bin/torchrun ... your_script.py                          # no change at all

torchrun starts the ranks and sets RANK, WORLD_SIZE, MASTER_ADDR/PORT; the script builds its process group from them
(``init_process_group()``), wraps the model in ``DistributedDataParallel`` and registers tzip's hook once, before the
first backward::

    ddp = DistributedDataParallel(model)
    state = tzip.ddp.LosslessState(codec="auto")
    ddp.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)

(``tzip.attach(model=ddp)`` does the same and can be called at any step; ``TZIP_ATTACH=1`` in the environment does it
for every DDP model of a job with no change to its code: see the README, "Attach, observe and steer".)

The run is made twice from the same weights, data and seeds, plain DDP and with the hook: the bundled
all-MiniLM-L6-v2 trained with its own objective on sentence pairs of its model card (examples/ddp_train.py's
batches and loss, each rank its own pairs), dropout on, AdamW. Every loss is compared by its float bits and the final
parameters of every rank by their bytes (sha256); the exit code is 1 when they differ (2 ranks: a sum of two does
not depend on the order; with more ranks compare ``--codec`` with ``--codec raw`` instead, as ddp_train.py does).
examples/ddp_train.py is the same comparison started with torch.multiprocessing, with more options.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ddp_train.py, beside this file

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from ddp_train import _batches, _loss  # noqa: E402


def train(use_tzip: bool, args, device: torch.device) -> dict:
    """One DDP training run on this rank; returns the losses' bits, the parameters' sha256 and the hook's figures."""
    import tzip.ddp
    from tzip import demo_data

    model = demo_data.load_model().to(device)
    model.pooler = None  # not part of the objective: every remaining parameter gets a gradient
    model.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # dropout masks: the same in both runs
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if use_tzip:  # the two lines
        state = tzip.ddp.LosslessState(codec=args.codec)
        ddp.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-5)
    losses = []
    for enc in _batches(world, rank, args.steps, args.batch, args.max_length, device):
        loss = _loss(ddp, enc, args.batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(f"{struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}")
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    out = {"losses": losses, "params": h.hexdigest()}
    if state is not None:
        out.update(bytes_raw=state.bytes_raw, bytes_sent=state.bytes_sent, buckets=state.buckets)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sentence pairs per rank and step")
    ap.add_argument("--max-length", type=int, default=32, help="tokens per sentence")
    ap.add_argument("--codec", choices=["auto", "fast", "max", "raw"], default="auto")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", action="store_true", help="print rank 0's summary as one JSON line")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        ap.error("launch it with torchrun: torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py")
    torch.use_deterministic_algorithms(True)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")  # rank, world size, address: torchrun's
    try:
        plain, tz = train(False, args, device), train(True, args, device)
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, {"rank": dist.get_rank(), "plain": plain, "tzip": tz})
    finally:
        dist.destroy_process_group()
    same = all(r["plain"] == {k: r["tzip"][k] for k in ("losses", "params")} for r in ranks)
    if ranks[0] is not None and int(os.environ["RANK"]) == 0:
        t = ranks[0]["tzip"]
        if args.json:
            print(json.dumps({"ranks": len(ranks), "codec": args.codec, "identical": same,
                              "loss_bits": {"plain": ranks[0]["plain"]["losses"], "tzip": t["losses"]},
                              "bytes_raw": t["bytes_raw"], "bytes_sent": t["bytes_sent"], "buckets": t["buckets"]}))
        else:
            print(f"torchrun + DDP + tzip's comm hook (codec {args.codec}): all-MiniLM-L6-v2, {len(ranks)} ranks, "
                  f"{args.steps} steps")
            for i, (pb, tb) in enumerate(zip(ranks[0]["plain"]["losses"], t["losses"])):
                print(f"step {i + 1}: loss bits {pb} (plain DDP) {'same' if tb == pb else tb} (tzip)")
            print(f"rank 0 gradients: {t['bytes_raw'] / 1e6:.2f} MB plain DDP would send, {t['bytes_sent'] / 1e6:.2f} MB "
                  f"sent ({t['bytes_sent'] / max(1, t['bytes_raw']):.4f})")
            print("bit-identical (losses by their float bits, parameters by their bytes, every rank): "
                  + ("yes" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
