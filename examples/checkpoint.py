"""Train the bundled all-MiniLM-L6-v2 on real text, checkpoint it compressed, resume, and get the same run to the bit.

    .venv/bin/python examples/checkpoint.py [--steps 2] [--resume-steps 2] [--device cpu|cuda] [--codec auto]
                                            [--socket PATH] [--dir DIR]

Three runs start from the same trained weights and see the same batches (consecutive sentence pairs of the model
card, the model's own contrastive objective as in tzip.demo_data, dropout on, AdamW):

1. the reference: ``--steps + --resume-steps`` steps without a checkpoint;
2. ``--steps`` steps, ``tzip.save`` of model, optimizer, step and RNG state, then a fresh model and optimizer
   restored with ``tzip.load`` train the remaining steps;
3. the same through ``torch.distributed.checkpoint`` with ``tzip.checkpoint.Writer`` / ``Reader``.

The loss of every step is printed with its bit pattern; the script exits 1 unless all three runs agree bit for bit
(losses, final parameters). Then the checkpoint of step ``--steps`` is written with ``torch.save``, safetensors
(its tensors only: safetensors holds no other values), DCP's ``FileSystemWriter``, the same with its ZStandard
extension (needs the ``zstandard`` package) and both tzip writers, and their sizes are printed. Sizes are bytes on
disk (MB = 10**6 bytes). The default run takes about a minute of CPU time (2 minutes on a busy 2-core machine). ``--socket``: a running daemon's
socket; by default tzip.connect() finds or starts one.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

# GPU kernels must be deterministic for two training runs to agree (cuBLAS needs this before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import tzip  # noqa: E402
import tzip.checkpoint  # noqa: E402
from tzip import demo_data as dd  # noqa: E402
from tzip._dlpack import int_alias  # noqa: E402


def f32_bits(x: torch.Tensor) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', x.item()))[0]:08x}"


def fresh(device: str):
    model = dd.load_model().to(device)
    model.train()  # dropout on: resuming must restore the RNG state too
    model.pooler.requires_grad_(False)  # the objective does not use the pooler (no gradient, no optimizer state)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5, weight_decay=0.01)
    return model, opt


def rng_state(device: str) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, device: str) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu())


def train(model, opt, data, device) -> list[torch.Tensor]:
    losses = []
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = dd.pair_loss(model, batch, device)
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return losses


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="steps before the checkpoint (default 2)")
    ap.add_argument("--resume-steps", type=int, default=2, help="steps after resuming (default 2)")
    ap.add_argument("--pairs", type=int, default=4, help="sentence pairs per step (default 4)")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per sentence (default 64)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--codec", default="auto", help="tzip codec (default auto)")
    ap.add_argument("--socket", default=None, help="a running daemon's socket (default: tzip.connect() finds one)")
    ap.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary folder)")
    args = ap.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU")
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", message=".*single process.*")  # DCP without a process group
    client = tzip.connect(args.socket)
    data = dd.pair_batches(args.steps + args.resume_steps, args.pairs, args.max_length)
    before, after = data[: args.steps], data[args.steps :]
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="tzip-checkpoint-")  # removed at the end
    work = Path(args.dir) if args.dir else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)

    print(f"device {device}, {args.steps} + {args.resume_steps} steps of {args.pairs} sentence pairs, codec {args.codec}")
    torch.manual_seed(0)
    model, opt = fresh(device)
    reference = train(model, opt, data, device)
    ref_params = {k: int_alias(v.detach().cpu()).clone() for k, v in model.state_dict().items()}

    # tzip.save / tzip.load
    torch.manual_seed(0)
    model, opt = fresh(device)
    losses_a = train(model, opt, before, device)
    ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "step": args.steps, "rng": rng_state(device)}
    tz_path = work / "ckpt.tzip"
    tzip.save(ckpt, tz_path, codec=args.codec, client=client)
    for_sizes = ckpt
    del model, opt
    model, opt = fresh(device)
    back = tzip.load(tz_path, client=client)
    model.load_state_dict(back["model"])
    opt.load_state_dict(back["optim"])
    set_rng_state(back["rng"], device)
    losses_a += train(model, opt, after, device)
    params_a = model.state_dict()

    # torch.distributed.checkpoint with tzip.checkpoint.Writer / Reader
    torch.manual_seed(0)
    model, opt = fresh(device)
    losses_b = train(model, opt, before, device)
    msd, osd = get_state_dict(model, opt)
    dcp_dir = work / "dcp-tzip"
    dcp.save({"model": msd, "optim": osd, "rng": rng_state(device)},
             storage_writer=tzip.checkpoint.Writer(dcp_dir, codec=args.codec, client=client))
    del model, opt, msd, osd
    model, opt = fresh(device)
    msd, osd = get_state_dict(model, opt)  # gives the fresh optimizer its state tensors (lr 0): DCP loads into them
    target = {"model": msd, "optim": osd, "rng": rng_state(device)}
    dcp.load(target, storage_reader=tzip.checkpoint.Reader(dcp_dir, client=client))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    set_rng_state(target["rng"], device)
    losses_b += train(model, opt, after, device)
    params_b = model.state_dict()

    print(f"{'step':>4} {'reference':>24} {'tzip.save/load':>24} {'DCP + tzip.checkpoint':>24}")
    same = True
    for i, (r, a, b) in enumerate(zip(reference, losses_a, losses_b)):
        ok = f32_bits(r) == f32_bits(a) == f32_bits(b)
        same &= ok
        mark = "" if ok else "  <-- differs"
        print(f"{i + 1:>4} {r.item():.7f} {f32_bits(r)} {a.item():.7f} {f32_bits(a)} {b.item():.7f} {f32_bits(b)}{mark}"
              + ("   (resumed)" if i == args.steps else ""))
    for name, params in (("tzip.save/load", params_a), ("DCP + tzip.checkpoint", params_b)):
        for k, v in params.items():
            if not torch.equal(int_alias(v.detach().cpu()), ref_params[k]):
                print(f"final parameter {k} of the {name} run differs from the reference")
                same = False

    # Sizes of the step-N checkpoint in every format.
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter

    cpu_ckpt = {"model": {k: v.detach().cpu() for k, v in for_sizes["model"].items()},
                "optim": for_sizes["optim"], "step": for_sizes["step"], "rng": for_sizes["rng"]}
    sizes: dict[str, int] = {}
    torch.save(cpu_ckpt, work / "ckpt.pt")
    sizes["torch.save"] = dir_bytes(work / "ckpt.pt")
    flat = {f"model.{k}": v for k, v in cpu_ckpt["model"].items()}
    for pid, st in cpu_ckpt["optim"]["state"].items():
        flat.update({f"optim.{pid}.{k}": v.detach().cpu() for k, v in st.items()})
    flat.update({f"rng.{k}": v for k, v in cpu_ckpt["rng"].items()})
    save_file(flat, str(work / "ckpt.safetensors"))
    sizes["safetensors (tensors only)"] = dir_bytes(work / "ckpt.safetensors")
    dcp.save(cpu_ckpt, storage_writer=FileSystemWriter(work / "dcp-fs"))
    sizes["DCP FileSystemWriter"] = dir_bytes(work / "dcp-fs")
    try:
        from torch.distributed.checkpoint._extension import ZStandard

        dcp.save(cpu_ckpt, storage_writer=FileSystemWriter(work / "dcp-zstd", _extensions=[ZStandard()]))
        sizes["DCP FileSystemWriter + ZStandard"] = dir_bytes(work / "dcp-zstd")
    except (ImportError, ValueError) as e:  # no zstandard / pyzstd package
        print(f"(DCP ZStandard skipped: {e})")
    sizes[f"tzip.save ({args.codec})"] = dir_bytes(tz_path)
    sizes[f"DCP tzip.checkpoint.Writer ({args.codec})"] = dir_bytes(dcp_dir)
    base = sizes["torch.save"]
    print(f"\ncheckpoint of step {args.steps} (model, AdamW state, step, RNG state): bytes on disk")
    for name, n in sizes.items():
        print(f"  {name:42s} {n / 1e6:9.2f} MB  {n / base:6.3f} of torch.save")
    if tmp is None:
        print(f"\nfiles in {work}")
    else:
        tmp.cleanup()
    print("losses and parameters bit-identical to the run without checkpoints: " + ("yes" if same else "NO"))
    client.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
