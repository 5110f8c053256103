"""Where the decode kernels launch as programmatic dependents: only on a GPU that has it, never interpreted (the
PTX they compile to on an H100 or H200 is checked by test_kernels_compile)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels.dependent import dependent


def test_a_cpu_tensor_launches_as_usual():
    assert dependent(torch.device("cpu")) == {"DEPENDENT": False}


def test_an_interpreted_launch_is_never_dependent(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dependent(torch.device("cuda", 0)) == {"DEPENDENT": False}
