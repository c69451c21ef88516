"""Benchmark of inference with weights kept compressed in GPU memory (tzip.inference) against plain bf16.

    python -m tzip.bench.inference [--weights PATH] [--layers 22] [--hidden 2048] [--batches 1,8,64]
                                   [--prefill 512] [--new-tokens 128] [--codecs fast,max] [--json PATH]

The model: a Llama causal LM of TinyLlama-1.1B's shape (hidden 2048, MLP 5632, 32 heads, 4 key/value heads, vocab
32000; ``--layers``/``--hidden`` scale it) in bf16, whose every weight matrix is tiled from the trained
all-MiniLM-L6-v2's bf16 matrices (``--weights``: its safetensors file, default data/demo/minilm-weights-bf16.safetensors,
made by ``python -m tzip.demo_data``). Its weight statistics are those of real trained weights; its outputs mean
nothing. No pretrained causal LM larger than this ships in a package of the registries this project can reach.

Rows, in one process on one GPU: ``bf16`` (plain), then each tzip codec resident (``compress_model`` of the same
model in place; decode into a shared scratch buffer per block, next block prefetched on a side stream), ``bf16
(again)`` (the same plain model after every tzip row, so that a difference plain bf16 makes between two calls is told
apart from one that tzip makes), and, when
``accelerate`` is importable, Accelerate's CPU offload of the share of the weights that tzip ``fast`` frees.
Columns: GPU memory of the weights (torch.cuda.memory_allocated, scratch included), compress time, prefill time of
``--prefill`` tokens at batch 1, and generated tokens/s at each batch size (greedy ``generate()`` of
``--new-tokens`` tokens after a ``--prefill``-token prompt; tokens/s counts the generated tokens over the whole call)
relative to bf16 (each the faster of two timed calls), whether the prompt's logits equal bf16's by their bits (the
check; the exit status is 1 when they do not), whether every generated token id equals a bf16 row's, and whether
the row's two calls generated the same ids (plain bf16 did not always, on an H100: docs/benchmarks.md). Also the decode rate of all frames of the model
(one block after another on the whole GPU, CUDA events). Prints the machine, the command and a table; ``--json``
writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from .. import _native
from ..inference import compress_model


def tiled(src: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``src`` repeated along every dimension and cut to ``shape`` (1-D sources tile 1-D shapes)."""
    reps = [math.ceil(s / d) for s, d in zip(shape, src.shape)]
    t = src.repeat(*reps)
    return t[tuple(slice(0, s) for s in shape)].contiguous()


def build_model(weights: Path, layers: int, hidden: int, device: torch.device):
    """The Llama model of the module docstring, bf16, on ``device``."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    src = load_file(str(weights))
    mats = [v for k, v in sorted(src.items()) if v.dim() == 2 and v.dtype == torch.bfloat16
            and "embeddings" not in k and min(v.shape) >= 384]
    norms = [v for k, v in sorted(src.items()) if k.endswith("LayerNorm.weight")]
    emb = src["embeddings.word_embeddings.weight"]
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 256 * 256, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), vocab_size=32000,
                      max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    k = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" in name:
                p.copy_(tiled(emb, tuple(p.shape)))
            elif p.dim() == 2:
                p.copy_(tiled(mats[k % len(mats)], tuple(p.shape)))
                k += 1
            else:
                p.copy_(tiled(norms[k % len(norms)], tuple(p.shape)))
    return model.to(device).eval(), cfg


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def weight_bytes(model, dev: torch.device, base: int) -> int:
    """Bytes the weights occupy: on a GPU, torch.cuda.memory_allocated above ``base`` (frames and scratch included);
    on the CPU, the parameters' bytes plus a compressed model's frames and scratch."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(dev) - base
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    cm = getattr(model, "tzip_compressed", None)
    return n + (cm.stats["compressed_bytes"] + cm.stats["scratch_bytes"] if cm is not None else 0)


def run_row(model, prompts: dict[int, torch.Tensor], new_tokens: int, prefill: torch.Tensor) -> dict:
    out = {}
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model(prefill[:, :16])  # warm-up (and the prefetch order is learnt)
        out["prefill_s"] = min(_sync_time(lambda: model(prefill)) for _ in range(3))
        # The prompt's logits by their bits (on the CPU, so that no row's memory figure holds another row's logits).
        out["logits"] = model(prefill).logits.detach().contiguous().view(-1).view(torch.uint8).cpu()
        for b, ids in prompts.items():
            # Warm-up at this batch size and prompt length: the first call of a shape pays for kernel selection and
            # allocations (seconds for the first generate() of a process), which no row should be charged.
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
            # Two timed calls, the faster counted: the first call of a row may still grow the caching allocator
            # (the key/value cache of every step), which the first row of a process pays and later rows do not.
            runs = []
            for _ in range(2):
                res = {}
                t = _sync_time(lambda: res.setdefault(
                    "ids", model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)))
                runs.append((t, res["ids"].cpu()))
            out[f"tok_s_b{b}"] = b * new_tokens / min(t for t, _ in runs)
            out[f"ids_b{b}"] = runs[0][1]
            out[f"repeatable_b{b}"] = torch.equal(runs[0][1], runs[1][1])
    return out


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two generated id tensors first differ: "shape X vs Y" or "row r, position p"."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    r, p = (a != b).nonzero()[0].tolist()
    return f"row {r}, position {p}"


def decode_rate(cm) -> float | None:
    """GB/s of original bytes: every block's frames decoded one block after another on the current stream (GPU)."""
    if cm.device.type != "cuda":
        return None
    stream = torch.cuda.current_stream()
    blocks = cm._blocks
    total = sum(w.nbytes for b in blocks for w in b.weights)
    for b in blocks:
        cm._decode_block(b, 0, stream)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for b in blocks:
            cm._decode_block(b, 0, stream)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    cm.check()
    return total / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.inference", description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=Path("data/demo/minilm-weights-bf16.safetensors"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--codecs", default="fast,max")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of the same code)")
    ap.add_argument("--no-offload", action="store_true", help="leave out the Accelerate CPU-offload row")
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/tzip-bench-inference"),
                    help="where the checkpoint rows write the model as safetensors and .tzip (local disk)")
    ap.add_argument("--no-checkpoint", action="store_true", help="leave out the checkpoint rows")
    ap.add_argument("--nondeterministic", action="store_true",
                    help="leave PyTorch's default kernel choice (by default the run asks for deterministic algorithms: "
                         "plain bf16 generate() gave different ids in two calls of one process without it, H100)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    a.argv = argv if argv is not None else sys.argv[1:]
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if not a.nondeterministic:
        # Before the first cuBLAS call of the process: the workspace setting PyTorch's reproducibility notes ask for.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _run(a)
    finally:  # a caller in the same process (the tests) gets its own setting back
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _run(a: argparse.Namespace) -> int:
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_inference: no CUDA GPU (--device cpu runs the same code on the CPU)", file=sys.stderr)
        return 2
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        print(f"machine: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, {platform.node()}")
    else:
        print(f"machine: CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, {platform.node()}")
    print("deterministic algorithms: " + ("off" if a.nondeterministic else
                                          f"on (CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']})"))
    print("command: python -m tzip.bench.inference " + " ".join(shlex.quote(x) for x in a.argv))
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    model, cfg = build_model(a.weights, a.layers, a.hidden, dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama, {a.layers} layers, hidden {a.hidden}, {n_params / 1e9:.3f} B parameters, bf16, weights tiled "
          f"from {a.weights.name}")
    batches = [int(x) for x in a.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, a.prefill), generator=g).to(dev) for b in batches}
    prefill = prompts[batches[0]][:1]
    rows = []
    ref = {"row": "bf16", "weights_gib": weight_bytes(model, dev, base) / 2**30, "compress_s": 0.0,
           **run_row(model, prompts, a.new_tokens, prefill)}
    rows.append(ref)
    fast_gib = None
    for codec in [c for c in a.codecs.split(",") if c]:
        for prefetch in ((True, False) if codec == "fast" and dev.type == "cuda" else (True,)):
            _sync()
            t0 = time.perf_counter()
            cm = compress_model(model, codec=codec, prefetch=prefetch)
            _sync()
            t_c = time.perf_counter() - t0
            r = {"row": f"tzip {codec}" + ("" if prefetch else " (no prefetch)"),
                 "weights_gib": weight_bytes(model, dev, base) / 2**30, "compress_s": t_c, "ratio": cm.stats["ratio"],
                 "scratch_gib": cm.stats["scratch_bytes"] / 2**30, "decode_gb_s": decode_rate(cm),
                 **run_row(model, prompts, a.new_tokens, prefill)}
            rows.append(r)
            if codec == "fast" and prefetch:
                fast_gib = r["weights_gib"]
            cm.decompress()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    # The uncompressed model once more, after every tzip row (cm.decompress() restored it): tells a difference that
    # tzip makes from one that plain bf16 makes between two calls of the same process (kernel choice, allocator).
    again = {"row": "bf16 (again)", "weights_gib": weight_bytes(model, dev, base) / 2**30, "compress_s": 0.0,
             **run_row(model, prompts, a.new_tokens, prefill)}
    rows.append(again)
    refs = [ref, again]
    ckpt = [] if a.no_checkpoint else checkpoint_rows(model, a.checkpoint_dir, dev)
    if not a.no_offload and fast_gib and dev.type == "cuda":
        try:
            rows.append(offload_row(model, cfg, fast_gib, prompts, a.new_tokens, prefill))
        except Exception as e:  # reported as a row, the rest of the table stands
            rows.append({"row": "accelerate offload", "error": f"{type(e).__name__}: {e}"[:300]})

    cols = ["row", "weights GiB", "x bf16", "ratio", "scratch GiB", "compress s", "decode GB/s", "prefill ms"] + \
        [f"tok/s b{b} (x bf16)" for b in batches] + ["logits == bf16", "ids == bf16", "repeatable"]
    print()
    print(" | ".join(cols))
    bad = False
    bf16_repeatable = {b: ref[f"repeatable_b{b}"] and again[f"repeatable_b{b}"]
                       and torch.equal(ref[f"ids_b{b}"], again[f"ids_b{b}"]) for b in batches}
    for r in rows:
        if "error" in r:
            print(f"{r['row']} | {r['error']}")
            continue
        cells = [r["row"], f"{r['weights_gib']:.3f}", f"{r['weights_gib'] / ref['weights_gib']:.3f}",
                 f"{r.get('ratio', 1.0):.4f}", f"{r.get('scratch_gib', 0.0):.3f}", f"{r['compress_s']:.2f}",
                 f"{r['decode_gb_s']:.0f}" if r.get("decode_gb_s") else "-", f"{r['prefill_s'] * 1e3:.1f}"]
        for b in batches:
            cells.append(f"{r[f'tok_s_b{b}']:.1f} ({r[f'tok_s_b{b}'] / ref[f'tok_s_b{b}']:.2f})")
        # The prompt's logits must equal bf16's by their bits (one forward: repeatable). Generated ids must equal those
        # of either plain bf16 run (the first row or "bf16 (again)"); where plain bf16 itself gave different ids in its
        # own calls, a difference is reported but does not fail the benchmark (it says so below the table).
        logits_same = torch.equal(r["logits"], ref["logits"])
        bad |= not logits_same
        cells.append("yes" if logits_same else "NO")
        same = [any(torch.equal(r[f"ids_b{b}"], x[f"ids_b{b}"]) for x in refs) for b in batches]
        bad |= not all(s_ or not bf16_repeatable[b] for b, s_ in zip(batches, same))
        cells.append("yes" if all(same) else "NO (" + ", ".join(
            f"b{b}: {_first_difference(r[f'ids_b{b}'], ref[f'ids_b{b}'])}" for b, ok in zip(batches, same) if not ok) + ")")
        rep = [b for b in batches if not r[f"repeatable_b{b}"]]
        cells.append("yes" if not rep else "NO (" + ", ".join(f"b{b}" for b in rep) + ")")
        print(" | ".join(cells))
    differ = [b for b in batches if not bf16_repeatable[b]]
    if differ:
        print("note: plain bf16 generated different ids in its own calls (its two rows, or two calls of one row) at "
              + ", ".join(f"b{b}" for b in differ) + ": the uncompressed model is not repeatable there, so an ids "
              "difference at those batch sizes is reported, not counted as a failure; the logits column is the check")
    if ckpt:
        print()
        print("checkpoint | file GB | ratio | write s (encode) | load s | x safetensors | identical")
        for r in ckpt:
            bad |= r["identical"] == "NO"
            print(f"{r['row']} | {r['file_gb']:.3f} | {r['ratio']:.4f} | {r['write_s']:.2f} | {r['load_s']:.3f} | "
                  f"{r['load_x']:.2f} | {r['identical']}")
    if a.json:
        figures = [{k: v for k, v in r.items() if not k.startswith("ids_") and k != "logits"} for r in rows]
        a.json.write_text(json.dumps({"rows": figures,
                                      "checkpoint": ckpt}, indent=1))
    return 1 if bad else 0


def checkpoint_rows(model, folder: Path, dev: torch.device) -> list[dict]:
    """The model's weights as a safetensors file, then as .tzip files written with the GPU encoder
    (tzip.files.compress_file); each loaded to the GPU (safetensors.torch.load_file(device=...) against
    tzip.files.load_file), best of 3, the page cache warm for both (the same file read just before)."""
    from safetensors.torch import load_file as st_load, save_file
    from ..files import compress_file, load_file
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "model.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(src))
    del state
    size = src.stat().st_size

    def best(fn) -> float:
        fn()
        out = []
        for _ in range(3):
            out.append(_sync_time(fn))
        return min(out)

    t_st = best(lambda: st_load(str(src), device=str(dev)))
    rows = [{"row": "safetensors", "file_gb": size / 1e9, "ratio": 1.0, "write_s": 0.0, "load_s": t_st, "load_x": 1.0,
             "identical": "-"}]
    ref = st_load(str(src), device=str(dev))
    for codec in ("fast", "auto"):
        dst = folder / f"model-{codec}.tzip"
        _sync()
        t0 = time.perf_counter()
        compress_file(src, dst, codec, dev)
        t_w = time.perf_counter() - t0
        t_l = best(lambda: load_file(dst, dev))
        got = load_file(dst, dev)
        same = list(got) == list(ref) and all(
            torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)) for k in ref)
        rows.append({"row": f"tzip {codec}", "file_gb": dst.stat().st_size / 1e9, "ratio": dst.stat().st_size / size,
                     "write_s": t_w, "load_s": t_l, "load_x": t_st / t_l, "identical": "yes" if same else "NO"})
        del got
        dst.unlink()
    src.unlink()
    del ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def offload_row(model, cfg, gpu_gib: float, prompts, new_tokens: int, prefill) -> dict:
    """Accelerate's dispatch_model with the decoder layers that do not fit ``gpu_gib`` of weights kept on the CPU
    (moved to the GPU for each forward by Accelerate's hooks)."""
    from accelerate import dispatch_model
    layers = cfg.num_hidden_layers
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()) / 2**30
    other = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30 - layers * per_layer
    on_gpu = max(0, min(layers, int((gpu_gib - other) / per_layer)))
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = 0 if i < on_gpu else "cpu"
    model = dispatch_model(model.cpu(), device_map=device_map)
    torch.cuda.empty_cache()
    mem = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda") / 2**30
    return {"row": f"accelerate offload ({layers - on_gpu}/{layers} layers on the CPU)", "weights_gib": mem,
            "compress_s": 0.0, **run_row(model, prompts, new_tokens, prefill)}


if __name__ == "__main__":
    sys.exit(main())
