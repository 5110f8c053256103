"""Where the Qwen3.5 hybrid's kernel tests run (Triton's interpreter on the CPU, else CUDA) and the KV pool
they share: PAGES pages of PAGE tokens."""

from __future__ import annotations

from executor_svc.kernels import interpreting

DEVICE = "cpu" if interpreting() else "cuda"
PAGE, PAGES = 4, 16
