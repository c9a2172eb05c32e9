"""The devices and dtypes the tests run on."""

import torch

# The CPU always; CUDA when this machine has it, in fp32 and in the half-precision types it runs. On a CPU-only
# machine the device-parametrised tests run once, as before (scripts/gpu_check.sh runs them on CUDA).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HALF_DTYPES = (
    [torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else []) if torch.cuda.is_available() else []
)
DEVICE_DTYPES = [(device, torch.float32) for device in DEVICES] + [("cuda", dtype) for dtype in HALF_DTYPES]
