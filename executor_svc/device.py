"""Resolution of the executor's device and dtype settings ("auto" included) into torch objects."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto = cuda when a GPU is visible, else cpu; cpu, cuda and cuda:N as torch spells them."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but no CUDA device is visible")
        if device.index is None:  # name the card, so that what Describe reports is exact
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA devices exist"
            )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on cuda, float32 on cpu (CPU half-precision matmuls are slow and less tested)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return _DTYPES[name]


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype, model_path: str) -> str:
    """auto = packed for a GGUF model on the CPU in float32 when the packed kernel builds here, else
    dequantize; packed asked for where it cannot run is a ValueError saying why."""
    from executor_svc.models import packed_kernel

    if name == "dequantize":
        return name
    reasons = []
    if device.type != "cpu":
        reasons.append(f"packed weights run on the CPU only, not {device}")
    if dtype != torch.float32:
        reasons.append(f"packed weights take float32 activations, not {dtype} (--dtype float32 or auto)")
    if not model_path.endswith(".gguf"):
        reasons.append(f"packed weights come from a quantized GGUF file, not {model_path}")
    if name == "auto":
        return "packed" if not reasons and packed_kernel.available() else "dequantize"
    if name != "packed":
        raise ValueError(f"weights must be auto, dequantize or packed, got {name!r}")
    if reasons:
        raise ValueError("; ".join(reasons))
    packed_kernel.library()  # KernelUnavailable (a RuntimeError) says why it cannot be built
    return name
