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


def test_a_hopper_gpu_launches_dependents_and_an_older_one_does_not(monkeypatch):
    import executor_svc.kernels.dependent as module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(module, "_supported", lambda index: index == 0)  # card 0 Hopper, card 1 older
    assert dependent(torch.device("cuda", 0)) == {"DEPENDENT": True, "launch_pdl": True}
    assert dependent(torch.device("cuda", 1)) == {"DEPENDENT": False}
