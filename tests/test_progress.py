"""Progress a person can see: the bar or log lines of long work, the planner's prefill lines for long prompts,
and where --weights lands the weights."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.device import resolve_weights
from executor_svc.models import packed_kernel
from planner_svc.prefill_progress import progress_line
from planner_svc.requests import Request
from protos.progress import Progress, bar, describe


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_describe_and_bar():
    assert (
        describe("loading", 120, 272, "tensors", 3.0) == "loading: 120/272 tensors (44%), 3.0 s, 40 tensors/s"
    )
    assert describe("loading", 0, 272, "tensors", 0.0) == "loading: 0/272 tensors (0%), 0.0 s"
    assert bar(5, 10, width=10) == "[#####.....]"
    assert bar(20, 10, width=4) == "[####]"


def test_progress_on_a_terminal_redraws_one_line():
    clock, out = Clock(), Terminal()
    with Progress("packing", total=4, unit="tensors", stream=out, clock=clock) as progress:
        progress.advance()  # within the first second: nothing shown
        assert out.getvalue() == ""
        clock.now = 1.5
        progress.advance()
    text = out.getvalue()
    assert text.startswith("\r[") and "packing: 2/4 tensors (50%)" in text and text.endswith("\n")
    assert text.count("\n") == 1


def test_progress_off_a_terminal_logs_every_interval(caplog):
    clock, out = Clock(), io.StringIO()
    with caplog.at_level(logging.INFO, logger="deltaserve.progress"):
        with Progress("round", total=10, stream=out, clock=clock, log_interval_s=5) as progress:
            for second in range(1, 11):
                clock.now = float(second)
                progress.advance()
    assert out.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    # at 1 s (the first shown), 6 s, and the last at close
    assert len(lines) == 3 and lines[0].startswith("round: 1/10") and lines[-1].startswith("round: 10/10")


def test_quick_work_shows_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve.progress"):
        with Progress("quick", total=3, stream=io.StringIO()) as progress:
            for _ in range(3):
                progress.advance()
    assert not caplog.records


def test_prefill_progress_lines_for_long_prompts_only():
    def request(name: str, tokens: int) -> Request:
        return Request(name, list(range(tokens)), max_tokens=1)

    short, long = request("short", 900), request("long", 2000)
    assert progress_line(short, 0, 256, 0.0, threshold=1000) is None
    started = progress_line(long, 0, 256, 0.0, threshold=1000, interval_s=5)
    assert started == {"request_id": "long", "read": 0, "of": 2000, "state": "started"}
    assert progress_line(long, 256, 512, 2.0, threshold=1000, interval_s=5) is None  # within the interval
    assert progress_line(long, 512, 768, 6.0, threshold=1000, interval_s=5)["read"] == 512
    last = progress_line(long, 768, 2000, 8.0, threshold=1000, interval_s=5)
    assert last == {
        "request_id": "long",
        "read": 2000,
        "of": 2000,
        "state": "last chunk",
        "seconds": 8.0,
        "tokens_per_s": 250,
    }
    assert long.prefill_read is None
    # A long prompt that mounted most of its tokens has too few to read to be followed.
    assert progress_line(request("mounted", 2000), 1900, 2000, 0.0, threshold=1000) is None


def test_weights_modes_resolve_by_device_dtype_and_file():
    cpu, gguf = torch.device("cpu"), "model.gguf"
    assert resolve_weights("dequantize", cpu, torch.float32, gguf) == "dequantize"
    assert resolve_weights("auto", cpu, torch.bfloat16, gguf) == "dequantize"
    assert resolve_weights("auto", cpu, torch.float32, "/models/hf-dir") == "dequantize"
    assert resolve_weights("auto", torch.device("cuda", 0), torch.bfloat16, gguf) == "dequantize"
    with pytest.raises(ValueError, match="CPU only.*float32 activations"):
        resolve_weights("packed", torch.device("cuda", 0), torch.bfloat16, gguf)
    with pytest.raises(ValueError, match="quantized GGUF"):
        resolve_weights("packed", cpu, torch.float32, "/models/hf-dir")
    with pytest.raises(ValueError, match="weights must be"):
        ExecutorConfig(weights="int4")
    if packed_kernel.available():
        assert resolve_weights("auto", cpu, torch.float32, gguf) == "packed"
        assert resolve_weights("packed", cpu, torch.float32, gguf) == "packed"
