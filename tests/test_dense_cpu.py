"""The CPU decode step in one C call (executor_svc/models/dense_cpu.c) against the torch layers it replaces: the
same logits (within float32 tolerance: only the order of sums differs) and the same K/V written, for dense
variants with packed weights (GQA, biases in every projection, q/k head norms, llama3 rope), rows of different
lengths on shuffled pages beside a padding row; and the torch layers wherever the C step cannot serve."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.attention.torch_ref import TorchDecode
from executor_svc.models import dense_cpu
from executor_svc.models.dense import DenseModel
from executor_svc.models.gguf_packing import pack_gguf
from executor_svc.models.loader import load_model
from executor_svc.models.packed import fuse_projections, install_packed
from executor_svc.models.packed_kernel import MAX_ROWS
from tests import tiny_families

PAGE = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if dense_cpu.library() is None:
        pytest.skip("no C compiler to build the CPU decode step")


def _model(variant: str, tmp_path: Path, type_name: str | None) -> DenseModel:
    """The variant's random checkpoint loaded on the CPU, its biases and norm weights made random too
    (transformers makes them 0 and 1: a step that dropped one would pass), its layers' projections packed as
    `type_name` (gguf's own quantizer) and fused, as the loader does for a GGUF; None: left float."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_families.hf_config(variant), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "cpu", torch.float32)
    assert isinstance(model, DenseModel)
    for name, param in model.named_parameters():
        if name.endswith(".bias") or "norm" in name:
            param.add_(0.3 * torch.randn_like(param))
    if type_name is not None:
        packed = {}
        for name, param in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                rows, cols = param.shape
                blocks = gguf.quants.quantize(param.numpy(), gguf.GGMLQuantizationType[type_name])
                packed[name] = pack_gguf(blocks, type_name, rows, cols)
        install_packed(model, packed)
        fuse_projections(model)
    return model


def _step(model: DenseModel, kv, tokens, kv_lens, tables, torch_layers: bool) -> torch.Tensor:
    if torch_layers:
        model.cpu_layers = (kv, None)  # what `over` answers where the C step cannot serve
    attention = TorchDecode(None, kv, model.scale, model.config.max_seq_len)
    inputs = attention.over(tokens, kv_lens.long(), kv_lens, tables)
    return model.forward(inputs, attention)


@pytest.mark.parametrize(
    ("variant", "type_name", "rows"),
    [("linear_biases", "Q4_1", 5), ("qwen3", "Q8_0", 8), ("llama3", "Q4_0", 1)],
)
def test_the_c_step_equals_the_torch_layers(variant, type_name, rows, tmp_path):
    model = _model(variant, tmp_path, type_name)
    c_kv = model.make_kv_pool(num_pages=64, page_size=PAGE)
    c_kv.k.normal_(), c_kv.v.normal_()  # stored K/V as if prompts had been read
    torch_kv = model.make_kv_pool(num_pages=64, page_size=PAGE)
    torch_kv.k.copy_(c_kv.k), torch_kv.v.copy_(c_kv.v)
    # Row 0 pads where there are several (length 0, the sink page's table); the others hold 5 to 70 positions
    # on shuffled pages.
    kv_lens = torch.tensor([0, 5, 37, 70, 12, 50, 3, 66][:rows] if rows > 1 else [37], dtype=torch.int32)
    pages = torch.randperm(63, generator=torch.Generator().manual_seed(1))[: rows * 6] + 1
    tables = pages.view(rows, 6).to(torch.int32)
    tokens = torch.randint(1, tiny_families.VOCAB, (rows,), generator=torch.Generator().manual_seed(2))
    real = slice(1, None) if rows > 1 else slice(None)
    if rows > 1:
        tables[0], tokens[0] = 0, 0
    for _ in range(3):
        c_logits = _step(model, c_kv, tokens, kv_lens, tables, torch_layers=False)
        assert model.cpu_layers is not None and model.cpu_layers[1] is not None, "the C step served"
        torch_logits = _step(model, torch_kv, tokens, kv_lens, tables, torch_layers=True)
        torch.testing.assert_close(c_logits[real], torch_logits[real], rtol=1e-4, atol=1e-4)
        assert torch.equal(c_logits[real].argmax(-1), torch_logits[real].argmax(-1))
        # Page 0 is the sink: the padding row's K/V go nowhere that is read.
        torch.testing.assert_close(c_kv.k[:, 1:], torch_kv.k[:, 1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_kv.v[:, 1:], torch_kv.v[:, 1:], rtol=1e-5, atol=1e-5)
        tokens = c_logits.argmax(-1)
        kv_lens[real] += 1
        if rows > 1:
            tokens[0] = 0


def test_the_torch_layers_serve_where_the_c_step_cannot(tmp_path):
    float_model = _model("qwen3", tmp_path / "float", None)
    kv = float_model.make_kv_pool(num_pages=4, page_size=PAGE)
    assert dense_cpu.CpuDecodeLayers.over(float_model, kv) is None, "float weights: the torch layers"
    packed = _model("qwen3", tmp_path / "packed", "Q8_0")
    kv = packed.make_kv_pool(num_pages=4, page_size=PAGE)
    assert dense_cpu.CpuDecodeLayers.over(packed, kv) is not None
    rows = MAX_ROWS + 1  # more rows than the C step takes: the torch layers
    tables = torch.ones(rows, 1, dtype=torch.int32)
    packed.cpu_layers = None
    _step(
        packed, kv, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int32), tables, False
    )
    assert packed.cpu_layers is None, "not consulted for a step it cannot take"


def test_loading_packed_weights_builds_the_c_step(monkeypatch):
    """At load, not on the first decode step: a first build takes seconds of compiler, and the planner's watchdog
    reads a first step that slow as a hung executor."""
    from executor_svc.models.loader import load_model as load
    from protos.model_files import default_model_path

    built = []
    monkeypatch.setattr(dense_cpu, "library", lambda: built.append(True))
    load(default_model_path(), "cpu", torch.float32, "packed")
    assert built, "the loader built the C decode step"


def test_a_short_prefill_runs_in_the_c_step(tmp_path, monkeypatch):
    """Two prompts (one continuing 5 stored positions) of 19 and 6 tokens read MAX_ROWS tokens a call: the same
    logits and K/V as the torch layers, each token seeing the K/V of the tokens before it."""
    from executor_svc.attention.prefill import PrefillAttention
    from executor_svc.models import dense
    from executor_svc.prefill.batch import PrefillBatch

    model = _model("linear_biases", tmp_path, "Q4_1")
    ids = torch.randint(1, tiny_families.VOCAB, (25,), generator=torch.Generator().manual_seed(3)).numpy()
    chunks = [(ids[:19], 0, np.array([3, 7])), (ids[19:], 5, np.array([9]))]
    results = []
    for c_step in (True, False):
        monkeypatch.setattr(dense, "CPU_PREFILL_TOKENS", 64 if c_step else 0)
        kv = model.make_kv_pool(num_pages=16, page_size=PAGE)
        kv.k[:, 9].normal_(generator=torch.Generator().manual_seed(4))  # the 5 stored positions
        kv.v[:, 9].normal_(generator=torch.Generator().manual_seed(5))
        batch = PrefillBatch.build(chunks, PAGE, model.config.max_seq_len, torch.device("cpu"))
        logits = model.forward(batch.inputs, PrefillAttention(kv, model.scale, batch, fused=False))
        assert (model.cpu_layers is not None and model.cpu_layers[1] is not None) == c_step
        model.cpu_layers = None
        results.append((logits, kv))
    (c_logits, c_kv), (torch_logits, torch_kv) = results
    torch.testing.assert_close(c_logits, torch_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(c_logits.argmax(-1), torch_logits.argmax(-1))
    torch.testing.assert_close(c_kv.k[:, 1:], torch_kv.k[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_kv.v[:, 1:], torch_kv.v[:, 1:], rtol=1e-5, atol=1e-5)
