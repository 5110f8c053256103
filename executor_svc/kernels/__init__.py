"""Triton kernels of the resident decode step; `triton_available()` says whether they can run here."""

from __future__ import annotations

import importlib.util
import os

import torch

# The values Triton itself reads as true for TRITON_INTERPRET.
_TRUE = ("1", "true", "yes", "on", "y")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def triton_available() -> bool:
    """True when triton imports and can run: on a CUDA device, or on CPU tensors under TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreting()
