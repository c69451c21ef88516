"""Hugging Face Trainer with tzip: one callback, ``Trainer(..., callbacks=[TzipCallback(codec="auto")])``.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/trainer_callback.py            # 2 gloo ranks, CPU
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/trainer_callback.py --offload-optimizer --steps 6
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/trainer_callback.py --device cuda   # a GPU per rank (not run yet)

Fine-tunes the bundled all-MiniLM-L6-v2 (tzip.demo_data: its trained weights and tokenizer) as a
``BertForSequenceClassification`` on sentences of its model card: does the second sentence follow the first
(label 1) or come from elsewhere in the card (label 0)? ``--layers`` keeps the first N of its 6 trained layers
(fewer: faster on a small CPU). The run is made twice from the same weights, data and seeds, with the real
``transformers.Trainer`` (DDP through Accelerate): without the callback and with it. Every logged loss is compared by
its float bits and the final parameters of every rank by their bytes (sha256); the exit code is 1 when they differ.
Rank 0 prints the table and the callback's ``tzip/...`` figures from the Trainer's logs.

The daemon is the one ``tzip.connect()`` finds or starts (``$TZIP_SOCKET``); without one the hook sends raw frames
and warns once. The functions here (``build_model``, ``build_dataset``, ``train``) are also what
python-bridge/tests/test_integrations_transformers.py trains with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (--device cuda)

import torch  # noqa: E402


def build_dataset(max_length: int = 32) -> list[dict[str, torch.Tensor]]:
    """The model card's sentences as (first, second) pairs, tokenized together (``[CLS] a [SEP] b [SEP]``, padded to
    ``max_length``): label 1 for consecutive sentences, 0 for a sentence paired with one from the other half of the
    card. Items: int64 tensors ``input_ids``, ``token_type_ids``, ``attention_mask`` of shape [max_length] and
    ``labels`` (0-dim)."""
    from tzip import demo_data

    s = demo_data.readme_sentences()
    tok = demo_data.load_tokenizer(max_length)
    n = len(s)
    pairs = [(s[i], s[i + 1], 1) for i in range(n - 1)] + [(s[i], s[(i + n // 2) % n], 0) for i in range(n - 1)]
    enc = tok.encode_batch([(a, b) for a, b, _ in pairs])
    return [{"input_ids": torch.tensor(e.ids), "token_type_ids": torch.tensor(e.type_ids),
             "attention_mask": torch.tensor(e.attention_mask), "labels": torch.tensor(label)}
            for e, (_, _, label) in zip(enc, pairs)]


def build_model(layers: int = 6, seed: int = 0):
    """all-MiniLM-L6-v2's trained weights (its first ``layers`` transformer layers) under a 2-label classification
    head initialised from ``seed``; F32 on the CPU, eager attention, dropout on (``train()``), offline."""
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from tzip import demo_data

    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized: classifier" and the unused layers: expected here
    try:
        model = BertForSequenceClassification.from_pretrained(
            str(demo_data.model_dir()), local_files_only=True, num_labels=2, num_hidden_layers=layers,
            attn_implementation="eager", dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.train()


def train(output_dir: str, callback=None, *, layers: int = 6, steps: int = 4, batch: int = 4, accumulation: int = 1,
          find_unused: bool | None = None, device: str = "cpu", save_steps: int | None = None,
          resume_from: str | bool | None = None, seed: int = 42, extra_callbacks: list | None = None):
    """One real ``Trainer.train()`` of :func:`build_model` on :func:`build_dataset`, DDP across the job's ranks
    (torchrun's environment) with gloo on the CPU, ``steps`` optimizer steps of ``batch`` examples per rank and
    micro-batch, ``accumulation`` micro-batches per step, a loss logged every step. ``callback``: a
    ``TrainerCallback`` (``TzipCallback``) or None. ``save_steps``: checkpoints under ``output_dir`` every so many
    steps; ``resume_from``: a checkpoint folder (or True: the last one) to resume from; ``extra_callbacks``: more
    callbacks, after ``callback``. Returns the Trainer."""
    from transformers import Trainer, TrainingArguments

    torch.use_deterministic_algorithms(True)
    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=5e-5, weight_decay=0.01,
        logging_steps=1, report_to="none", disable_tqdm=True, seed=seed, data_seed=seed,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_only_model=False,
        use_cpu=device == "cpu",
        # gloo on the CPU (Accelerate would take MPI where torch has it); one process: no backend at all
        ddp_backend="gloo" if device == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        ddp_find_unused_parameters=find_unused, dataloader_num_workers=0)
    trainer = Trainer(model=build_model(layers), args=args, train_dataset=build_dataset(),
                      callbacks=([callback] if callback is not None else []) + list(extra_callbacks or []))
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def loss_bits(trainer) -> list[str]:
    """The losses the Trainer logged (one per step, the mean over ranks and micro-batches), as the hex of their
    float64 bits."""
    return [f"{struct.unpack('<Q', struct.pack('<d', e['loss']))[0]:016x}" for e in trainer.state.log_history
            if "loss" in e]


def params_sha256(model) -> str:
    """sha256 of every parameter's bytes, in ``named_parameters`` order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from tzip.integrations.transformers import TzipCallback

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6, help="trained transformer layers kept (1-6)")
    ap.add_argument("--batch", type=int, default=4, help="examples per rank and micro-batch")
    ap.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--codec", choices=["auto", "fast", "max", "raw"], default="auto")
    ap.add_argument("--offload-optimizer", action="store_true", help="also keep AdamW's state compressed")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        ap.error("launch it with torchrun: torchrun --standalone --nproc-per-node 2 examples/trainer_callback.py")
    common = dict(layers=args.layers, steps=args.steps, batch=args.batch, accumulation=args.accumulation,
                  device=args.device)
    with tempfile.TemporaryDirectory(prefix="tzip-trainer-") as d:
        plain = train(os.path.join(d, "plain"), None, **common)
        cb = TzipCallback(codec=args.codec, offload_optimizer=args.offload_optimizer)
        tz = train(os.path.join(d, "tzip"), cb, **common)
    mine = {"rank": dist.get_rank(), "plain": (loss_bits(plain), params_sha256(plain.model)),
            "tzip": (loss_bits(tz), params_sha256(tz.model)),
            "figures": [{k: v for k, v in e.items() if k.startswith("tzip/")} for e in tz.state.log_history
                        if "loss" in e], "losses": [e["loss"] for e in tz.state.log_history if "loss" in e]}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    same = all(r["plain"] == r["tzip"] for r in ranks)
    if dist.get_rank() == 0:
        print(f"Trainer + TzipCallback(codec={args.codec!r}{', offload_optimizer=True' if args.offload_optimizer else ''}): "
              f"all-MiniLM-L6-v2 ({args.layers} layers) as a classifier, {len(ranks)} ranks, {args.steps} steps")
        print(f"{'step':>4} │ {'loss':>10} │ {'loss bits (no tzip)':>18} │ {'with TzipCallback':>18} │ "
              f"{'MB plain DDP':>12} │ {'MB tzip':>8} │ ratio")
        p_bits, t_bits = ranks[0]["plain"][0], ranks[0]["tzip"][0]
        for i, (pb, tb) in enumerate(zip(p_bits, t_bits)):
            f = ranks[0]["figures"][i]
            ratio = f"{f['tzip/ratio']:.4f}" if "tzip/ratio" in f else "-"
            print(f"{i + 1:>4} │ {ranks[0]['losses'][i]:>10.6f} │ {pb:>18} │ {'same' if tb == pb else tb:>18} │ "
                  f"{f.get('tzip/bytes_raw', 0) / 1e6:>12.2f} │ {f.get('tzip/bytes_sent', 0) / 1e6:>8.2f} │ {ratio}")
        for r in ranks:
            print(f"rank {r['rank']}: final parameters sha256 {r['plain'][1][:16]} (no tzip), "
                  f"{'same' if r['tzip'][1] == r['plain'][1] else r['tzip'][1][:16]} (TzipCallback)")
        print("bit-identical (losses by their float bits, parameters by their bytes, every rank): "
              + ("yes" if same else "NO"))
        print("(MB: 10^6 bytes rank 0 sent for the gradients since training began, the Trainer's tzip/bytes_raw and "
              "tzip/bytes_sent)")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
