# Safetensors input of the legacy-layout fixture (test/golden/containers/README.md).
import math, sys
import torch
from safetensors.torch import save_file

i = torch.arange(64, dtype=torch.float64)
wave = torch.complex((torch.sin(i * 0.37) * 0.05).float(), (torch.cos(i * 0.11) * 0.02).float())
tensors = {
    "c64.weight": wave.reshape(8, 8).contiguous(),
    "c64.scalar": torch.tensor(1.5 - 0.25j, dtype=torch.complex64),
    "c64.empty": torch.zeros(0, 3, dtype=torch.complex64),
    "f32.bias": (torch.arange(48, dtype=torch.float32) - 24) / 7,
    "bf16.weight": (torch.sin(torch.arange(128, dtype=torch.float32) * 0.3) * 0.1).to(torch.bfloat16).reshape(4, 32),
    "f16.deep": torch.arange(6, dtype=torch.float16).reshape(*([1] * 31), 2, 3),
}
save_file(tensors, sys.argv[1], metadata={"fixture": "c64 legacy layout"})
