"""Train the bundled real model with DistributedDataParallel, with and without tzip's lossless comm hook, and show
that every loss and the final parameters are bit-identical while fewer bytes cross the wire.

    .venv/bin/python examples/ddp_train.py                  # 2 ranks on the CPU (gloo), 3 steps
    .venv/bin/python examples/ddp_train.py --ranks 4 --steps 5 --dtype bfloat16
    .venv/bin/python examples/ddp_train.py --device cuda    # NCCL when there is a GPU per rank, else gloo
    .venv/bin/python examples/ddp_train.py --json           # one JSON object instead of the table

The model is all-MiniLM-L6-v2 (tzip.demo_data: the trained BertModel, 22.7 M parameters) trained with its own
objective (symmetric in-batch cross-entropy of scaled cosine similarities) on sentence pairs of its model card, each
rank on its own pairs, dropout on, AdamW. The same run is made three times from the same weights, data and seeds:
plain DDP, the hook with codec="raw" (the same algorithm uncompressed) and the hook compressing (--codec). The losses
are compared by their float bits, the final parameters by their bytes (sha256), on every rank.

What must agree: the compressing hook with the raw hook, always; both with plain DDP when there are two ranks (a sum
of two numbers does not depend on their order; with more ranks plain DDP sums in gloo's ring order and may differ
in the last bits, which is reported, not a failure). The exit code is 1 when something that must agree does not.

Bytes on the wire are this rank's, per step: plain DDP's ring all-reduce sends 2 * (n-1)/n of every bucket (the
hook's ``bytes_raw``); the hook sends its frames and headers (``bytes_sent``). The daemon is the one
``tzip.connect()`` finds or starts (``$TZIP_SOCKET``); without one the hook sends raw frames and warns once.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import os
import struct
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (--device cuda), for every rank

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

MODES = ("plain", "raw")  # then the compressing codec


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _batches(world: int, rank: int, steps: int, batch: int, max_length: int, device):
    from tzip import demo_data

    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())
    tok = demo_data.load_tokenizer(max_length)
    for step in range(steps):
        start = (step * world + rank) * batch
        chosen = [pairs[(start + i) % len(pairs)] for i in range(batch)]
        enc = demo_data.tokenize([a for a, _ in chosen] + [b for _, b in chosen], tok)  # one forward per backward
        yield {k: v.to(device) for k, v in enc.items()}


def _loss(model, enc, k: int):
    from tzip import demo_data

    emb = demo_data.mean_pool_normalize(model(**enc).last_hidden_state, enc["attention_mask"])
    return demo_data.contrastive_loss(emb[:k], emb[k:])


def _train(base, mode: str, args, rank: int, world: int, device) -> dict:
    import tzip.ddp

    model = copy.deepcopy(base).to(device)
    torch.manual_seed(1234 + rank)  # dropout masks: the same in every mode
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    state = None
    if mode != "plain":
        state = tzip.ddp.LosslessState(codec=mode)
        ddp.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    steps = []
    for enc in _batches(world, rank, args.steps, args.batch, args.max_length, device):
        before = (state.bytes_raw, state.bytes_sent) if state else (0, 0)
        t0 = time.perf_counter()
        loss = _loss(ddp, enc, args.batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        value = float(loss.detach().float().cpu())
        sent = (state.bytes_raw - before[0], state.bytes_sent - before[1]) if state else (None, None)
        steps.append({"loss": value, "loss_bits": _bits(value), "seconds": seconds, "bytes_raw": sent[0],
                      "bytes_sent": sent[1]})
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"steps": steps, "params_sha256": h.hexdigest()}


def _rank_main(rank: int, world: int, args, store_path: str, out_path: str) -> None:
    from tzip import demo_data

    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        base = demo_data.load_model()
        base.pooler = None  # not part of the objective: every remaining parameter gets a gradient
        base.train()
        if args.dtype == "bfloat16":
            base = base.to(torch.bfloat16)
        runs = {mode: _train(base, mode, args, rank, world, device) for mode in (*MODES, args.codec)}
        import tzip._default

        mine = {"rank": rank, "runs": runs, "backend": backend, "device": str(device),
                "daemon": bool(tzip._default.default_client().connected),
                "params": sum(p.numel() for p in base.parameters())}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def summarize(ranks: list[dict], codec: str) -> dict:
    """Which runs agree bit for bit, and the bytes per step (rank 0's, and the mean over ranks)."""
    world = len(ranks)
    modes = (*MODES, codec)

    def same(a: str, b: str) -> bool:
        return all([s["loss_bits"] for s in r["runs"][a]["steps"]] == [s["loss_bits"] for s in r["runs"][b]["steps"]]
                   and r["runs"][a]["params_sha256"] == r["runs"][b]["params_sha256"] for r in ranks)

    replicas = all(len({r["runs"][m]["params_sha256"] for r in ranks}) == 1 for m in modes)
    codec_vs_raw = same(codec, "raw")
    vs_plain = same(codec, "plain") and same("raw", "plain")
    steps = []
    for i, s0 in enumerate(ranks[0]["runs"][codec]["steps"]):
        raw = sum(r["runs"][codec]["steps"][i]["bytes_raw"] for r in ranks) / world
        sent = sum(r["runs"][codec]["steps"][i]["bytes_sent"] for r in ranks) / world
        steps.append({
            "step": i + 1, "loss": s0["loss"],
            "loss_bits": {m: f"0x{ranks[0]['runs'][m]['steps'][i]['loss_bits']:08x}" for m in modes},
            "mb_plain": raw / 1e6, "mb_tzip": sent / 1e6, "saved": 1 - sent / raw if raw else 0.0,
            "seconds": {m: ranks[0]["runs"][m]["steps"][i]["seconds"] for m in modes},
        })
    ok = codec_vs_raw and replicas and (vs_plain or world != 2)
    return {"ranks": world, "codec": codec, "backend": ranks[0]["backend"], "device": ranks[0]["device"],
            "daemon": all(r["daemon"] for r in ranks), "parameters": ranks[0]["params"], "steps": steps,
            "params_sha256": {m: ranks[0]["runs"][m]["params_sha256"] for m in modes},
            "identical": {"codec_vs_raw": codec_vs_raw, "vs_plain_ddp": vs_plain, "replicas": replicas},
            "plain_must_match": world == 2, "ok": ok}


def print_table(s: dict, args) -> None:
    c = s["codec"]
    print(f"tzip DDP example: all-MiniLM-L6-v2 ({s['parameters'] / 1e6:.1f} M parameters, {args.dtype}) on real text, "
          f"{s['ranks']} ranks ({s['backend']}, {s['device'].split(':')[0]}), {len(s['steps'])} steps, codec {c}"
          + ("" if s["daemon"] else "  [no daemon: raw frames]"))
    head = ["step", "loss", "plain DDP", "hook raw", f"hook {c}", "MB/step plain", "MB/step tzip", "saved",
            "s plain", f"s {c}"]
    rows = []
    for st in s["steps"]:
        b = st["loss_bits"]
        rows.append([str(st["step"]), f"{st['loss']:.7f}", b["plain"], "same" if b["raw"] == b["plain"] else b["raw"],
                     "same" if b[c] == b["plain"] else b[c], f"{st['mb_plain']:.2f}", f"{st['mb_tzip']:.2f}",
                     f"{100 * st['saved']:.1f}%", f"{st['seconds']['plain']:.2f}", f"{st['seconds'][c]:.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "│ " + " │ ".join(x.rjust(w) for x, w in zip(cells, widths)) + " │"  # noqa: E731
    print(line(head))
    for r in rows:
        print(line(r))
    sha = s["params_sha256"]
    print(f"final parameters sha256: plain {sha['plain'][:16]}, raw {'same' if sha['raw'] == sha['plain'] else sha['raw'][:16]}, "
          f"{c} {'same' if sha[c] == sha['plain'] else sha[c][:16]}")
    ident = s["identical"]
    print(f"bit-identical: hook {c} vs hook raw: {'yes' if ident['codec_vs_raw'] else 'NO'}; vs plain DDP: "
          f"{'yes' if ident['vs_plain_ddp'] else ('NO' if s['plain_must_match'] else 'no (expected with more than 2 ranks: gloo sums in ring order)')}; "
          f"replicas agree: {'yes' if ident['replicas'] else 'NO'}")
    print("(losses of every rank and step by their float bits, final parameters by their bytes; MB are 10^6 bytes "
          "this rank sends per step, the mean over ranks)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sentence pairs per rank and step")
    ap.add_argument("--max-length", type=int, default=32, help="tokens per sentence")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--codec", choices=["auto", "fast", "max"], default="auto")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here")
    with tempfile.TemporaryDirectory(prefix="tzip-ddp-") as d:
        out_path = os.path.join(d, "result.json")
        mp.spawn(_rank_main, args=(args.ranks, args, os.path.join(d, "store"), out_path), nprocs=args.ranks, join=True)
        with open(out_path) as f:
            ranks = json.load(f)
    s = summarize(ranks, args.codec)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print_table(s, args)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
