"""tzip: lossless GPU/CPU compression for PyTorch tensors.

tzip compresses the raw bytes of tensors -- bf16/fp16/fp32 model weights and
gradients, and any other safetensors dtype -- without losing a bit: a
decompressed tensor is byte-identical to the original. Floating-point data is
coded field by field (the exponents of real weights and gradients take few
distinct values and compress well; the remaining bits much less). The codec
runs on the CPU and, where available, on an NVIDIA GPU, and writes one
self-describing frame per tensor (docs/format.md).

This Python package is the bridge to that codec. For now it holds the
demo/benchmark inputs (:mod:`tzip.demo_data`); the daemon client comes later.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
