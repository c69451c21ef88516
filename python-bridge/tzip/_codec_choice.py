"""The codec names a call may ask for, and the one a call gets when it names none (``codec=None``).

``auto`` is a pure function of the data and the options, so the CPU and the GPU write the same bytes for it
(docs/format.md); it cannot look at speed. What speed asks for is chosen here instead, by where the tensor lies:

- a CPU tensor gets ``auto`` (the best ratio of ``fast`` and ``max`` for the data);
- a CUDA tensor gets ``fast``: on the GPU it is the codec that comes nearest to a network link's pace (50-100 GB/s
  per GPU). On 10 of an H200's 132 SMs, MiniLM bf16 weights, ``fast`` encodes 81.4 GB/s at ratio 0.7038 and ``max``
  (what ``auto`` picks for these weights) 2.3 GB/s at 0.6652 (docs/benchmarks.md, "GPU encoder at memory speed" and
  "GPU codecs"; ``scripts/gpu-check.sh``): 35 times the speed for 6% more bytes. A caller who wants the better ratio
  names ``codec="max"`` or ``"auto"``.

The daemon applies the same rule to requests without a codec (docs/protocol.md, "compress"), and a job's codec
setting (``tzip set JOB codec=...``) wins over both.
"""

from __future__ import annotations

#: Codec names of ``Client.compress(codec=...)`` and the integrations (docs/format.md, section 4).
CODECS = ("auto", "fast", "max", "bytes", "raw")
#: The codec a CUDA tensor gets when the call names none.
GPU_DEFAULT_CODEC = "fast"
#: The codec a CPU tensor gets when the call names none.
CPU_DEFAULT_CODEC = "auto"


def check_codec(codec: str | None) -> None:
    """Raises ValueError unless ``codec`` is one of :data:`CODECS` or None (the default by device)."""
    if codec is not None and codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}, or None (fast on a GPU, auto on the CPU)")


def codec_for(codec: str | None, on_gpu: bool) -> str:
    """The codec of a request: ``codec`` when the caller named one, else :data:`GPU_DEFAULT_CODEC` for tensors on a
    GPU (``on_gpu``) and :data:`CPU_DEFAULT_CODEC` for CPU tensors."""
    if codec is not None:
        return codec
    return GPU_DEFAULT_CODEC if on_gpu else CPU_DEFAULT_CODEC
