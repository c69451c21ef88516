"""The staging-copy helpers of the GPU client path (tzip._cuda: regions_of, gpu_copy_many, gpu_bytes_of).

They only use PyTorch tensor operations, so they run on the CPU here and on CUDA where there is a GPU
(the CUDA cases skip with a reason otherwise). Every comparison is of raw bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tzip._cuda import gpu_bytes_of, gpu_copy_many, regions_of

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to PyTorch")),
]


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s values in C order, read through an integer alias on the host (no float canonicalisation)."""
    t = t.detach().cpu().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints).numpy().tobytes()


# (gap before, size) pairs: regions in increasing order, some empty, some touching.
_layouts = st.lists(st.tuples(st.integers(0, 96), st.integers(0, 200)), min_size=0, max_size=40)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(layout=_layouts)
def test_regions_of_cuts_the_regions_asked(device: str, layout: list[tuple[int, int]]) -> None:
    regions, end = [], 0
    for gap, n in layout:
        regions.append((end + gap, n))
        end += gap + n
    arena = (torch.arange(end + 64, dtype=torch.int64) % 251).to(torch.uint8).to(device)
    views = regions_of(arena, regions)
    assert len(views) == len(regions)
    for (off, n), v in zip(regions, views):
        assert v.numel() == n and v.dtype == torch.uint8 and v.is_contiguous()
        assert _raw(v) == _raw(arena[off : off + n])
        if n:
            assert v.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert v.storage_offset() == arena.storage_offset() + off


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=0, max_size=30), seed=st.integers(0, 2**31 - 1))
def test_gpu_copy_many_copies_every_pair(device: str, sizes: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8).to(device) for n in sizes]
    arena = torch.zeros(sum(sizes) + 8 * len(sizes), dtype=torch.uint8, device=device)
    regions, off = [], 0
    for n in sizes:
        regions.append((off, n))
        off += n + 8
    dsts = regions_of(arena, regions)
    gpu_copy_many(dsts, srcs)
    for s, d in zip(srcs, dsts):
        assert _raw(d) == _raw(s)
    # the gaps between regions are untouched
    mask = torch.ones(arena.numel(), dtype=torch.bool)
    for o, n in regions:
        mask[o : o + n] = False
    assert not arena.cpu()[mask].any()


def _special_bf16() -> torch.Tensor:
    """bf16 bit patterns float equality hides: -0.0, NaNs with payloads and both signs, infinities, subnormals."""
    bits = [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC3, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x3F80, 0xC2F7]
    return torch.tensor(bits * 3, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["bf16 specials", "bf16 transposed", "fp32 slice with step", "bool", "complex64 view",
                                  "0-d fp16", "empty", "int64 expanded", "uint8 odd offset"])
def test_gpu_bytes_of_is_the_c_order_bytes(device: str, case: str) -> None:
    g = torch.Generator().manual_seed(7)
    if case == "bf16 specials":
        t = _special_bf16()
    elif case == "bf16 transposed":
        t = _special_bf16().reshape(6, 6).t()
    elif case == "fp32 slice with step":
        t = torch.randn(64, generator=g).view(torch.int32).bitwise_or(1).view(torch.float32)[3::5]
    elif case == "bool":
        t = torch.rand(33, generator=g) > 0.5
    elif case == "complex64 view":
        t = torch.randn(10, 4, dtype=torch.complex64, generator=g)[:, 1]
    elif case == "0-d fp16":
        t = torch.tensor(-0.0, dtype=torch.float16)
    elif case == "empty":
        t = torch.empty(0, 5, dtype=torch.bfloat16)
    elif case == "int64 expanded":
        t = torch.arange(4, dtype=torch.int64).reshape(4, 1).expand(4, 3)
    else:
        t = torch.arange(40, dtype=torch.int32).to(torch.uint8)[1:]
    t = t.to(device)
    b = gpu_bytes_of(t)
    assert b.dtype == torch.uint8 and b.dim() == 1 and b.device == t.device
    assert b.numel() == t.numel() * t.element_size()
    assert _raw(b) == _raw(t)
