"""The Qwen3.5 hybrid's decode step and prefill batch in the Triton kernels (qwen3_5_kernels, the CUDA path)
equal its torch forward: the logits, the K/V written, the conv windows and recurrent states moved on at
each row's slot, a padding row leaving the sink slot zero; two stages of a layer split equal the whole
model, in either; a bf16 prefill replayed from its CUDA graph equals the eager one. Under Triton's
interpreter on the CPU, or on CUDA."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from executor_svc.attention import StepInputs
from executor_svc.attention.torch_ref import decode_attention, prefill_attention_batch
from executor_svc.kernels import interpreting
from executor_svc.models.loader import stage_weights
from executor_svc.models.qwen3_5_config import FULL, LINEAR, Qwen35Config
from executor_svc.models.qwen3_5_model import Qwen35Model
from executor_svc.prefill.batch import PrefillBatch
from executor_svc.stage import Stage
from executor_svc.state_pool import StateInputs
from protos.layer_split import LayerRange
from tests.hybrid_kernel_shapes import DEVICE, PAGE, PAGES

pytestmark = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)


class _Attention:
    """Decode attention over block tables (torch_ref's), the model's other ops picked by `fused`."""

    def __init__(self, kv, tables: torch.Tensor, lens: torch.Tensor, scale: float, fused: bool):
        self.kv, self.tables, self.lens, self.scale, self.fused = kv, tables, lens, scale, fused

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, self.kv.k[layer], self.kv.v[layer], self.tables, self.lens, self.scale)


def _model(tied: bool = False) -> Qwen35Model:
    config = Qwen35Config(
        vocab_size=96,
        hidden_size=32,
        layer_types=(LINEAR, LINEAR, FULL),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rotary_dim=4,
        linear_key_heads=2,
        linear_value_heads=4,  # two value heads a key head, as the larger checkpoints have
        linear_key_dim=8,
        linear_value_dim=12,  # not a power of two
        conv_width=4,
        intermediate_size=48,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_seq_len=64,
        tie_embeddings=tied,
        eos_token_ids=(1,),
        bos_token_id=None,
        name="tiny",
    )
    model = Qwen35Model(config, DEVICE, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return model


def _decode_step(
    model: Qwen35Model, batch: int
) -> tuple[StepInputs, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's inputs over a random KV pool and state pool (`inputs.states.pool`), the last row padding;
    its block tables and stored lengths."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    kv = model.make_kv_pool(PAGES, PAGE)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    pool = model.make_state_pool(2 * batch + 1)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g))
    pool.conv[:, 0], pool.recurrent[:, 0] = 0, 0
    slots = torch.arange(2, 2 * batch + 2, 2) - 1  # distinct odd slots; the last row padding (slot 0)
    slots[-1] = 0
    lens = torch.randint(1, 2 * PAGE, (batch,), generator=g)  # stored lengths, before this step
    tables = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2) + 1  # two pages a row, page 0 the sink
    inputs = StepInputs(
        tokens=torch.randint(0, cfg.vocab_size, (batch,), generator=g).to(DEVICE),
        positions=lens.to(DEVICE),
        kv_lens=lens.int().to(DEVICE),
        write_page=tables[torch.arange(batch), lens // PAGE].to(DEVICE),
        write_offset=(lens % PAGE).int().to(DEVICE),
        states=StateInputs(pool, slots.to(DEVICE)),
    )
    return inputs, kv, tables, lens


def _run(model: Qwen35Model, inputs: StepInputs, kv, tables, lens, fused: bool, layers=(0, 3)):
    """The step on copies of the pools' layers [layers) (a stage's): its output (logits, or None before the
    last stage), and the pools it wrote."""
    assert inputs.states is not None
    kinds = model.config.layer_types
    kv_layers = slice(kinds[: layers[0]].count(FULL), kinds[: layers[1]].count(FULL))
    state_layers = slice(kinds[: layers[0]].count(LINEAR), kinds[: layers[1]].count(LINEAR))
    pool = inputs.states.pool
    kv_run, pool_run = model.make_kv_pool(PAGES, PAGE), model.make_state_pool(pool.num_slots)
    kv_run.k.copy_(kv.k[kv_layers]), kv_run.v.copy_(kv.v[kv_layers])
    pool_run.conv.copy_(pool.conv[state_layers]), pool_run.recurrent.copy_(pool.recurrent[state_layers])
    attention = _Attention(kv_run, tables.to(DEVICE), (lens + 1).int().to(DEVICE), model.scale, fused)
    out = model(inputs._replace(states=StateInputs(pool_run, inputs.states.slots)), attention)
    return out, kv_run, pool_run


@pytest.mark.parametrize(
    ("batch", "joined"), [(3, True), (6, True), (6, False)]
)  # the GEMV path (<= 4 rows) and the cuBLAS one; the gated delta nets in one kernel, or three (a wide batch's)
def test_fused_decode_step_equals_the_torch_forward(batch: int, joined: bool, monkeypatch):
    from executor_svc.kernels import gated_delta_joined

    if not joined:
        monkeypatch.setattr(gated_delta_joined, "_JOINED_STEP_HEADS", 0)
    model = _model()
    inputs, kv, tables, lens = _decode_step(model, batch)
    (expected, kv_ref, pool_ref), (logits, kv_fused, pool_fused) = (
        _run(model, inputs, kv, tables, lens, fused) for fused in (False, True)
    )
    real = inputs.states.slots.cpu() != 0
    torch.testing.assert_close(logits.cpu()[real], expected.cpu()[real], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(kv_fused.k[:, 1:].cpu(), kv_ref.k[:, 1:].cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_fused.v[:, 1:].cpu(), kv_ref.v[:, 1:].cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fused.conv.cpu(), pool_ref.conv.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fused.recurrent.cpu(), pool_ref.recurrent.cpu(), atol=1e-4, rtol=1e-4)
    assert (pool_fused.conv[:, 0] == 0).all() and (pool_fused.recurrent[:, 0] == 0).all()


class _PrefillAttention:
    """A packed prefill batch's attention chunk by chunk (torch_ref's), the model's other ops picked by `fused`."""

    def __init__(self, kv, batch: PrefillBatch, scale: float, fused: bool):
        self.kv, self.batch, self.scale, self.fused = kv, batch, scale, fused

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return prefill_attention_batch(q, self.kv.k[layer], self.kv.v[layer], self.batch, self.scale)


@pytest.mark.parametrize("blocks", [False, True])
def test_fused_prefill_equals_the_torch_forward(blocks: bool, monkeypatch):
    """A prefill batch in the Triton kernels (the CUDA path; its gated delta nets' conv and rule in the model's
    prefill, the reference here) equals the torch forward: the logits of each chunk's last token, the K/V
    written, the states at each sequence's slot. A chunk continuing a sequence (its pages and state held), two
    fresh ones, one of a single token. Its 16 tokens in the gated attention's kernels a row a program, or as a
    prefill wider than a decode step launches them (blocks of rows)."""
    from executor_svc.kernels import gated_attention

    if blocks:
        monkeypatch.setattr(gated_attention, "DECODE_ROWS", 0)
    model = _model()
    g = torch.Generator().manual_seed(3)
    kv = model.make_kv_pool(PAGES, PAGE)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    pool = model.make_state_pool(5)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g))
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=g).numpy()
    chunks = [
        (ids[:6], 5, np.array([1, 2, 3])),
        (ids[6:15], 0, np.array([4, 5, 6])),
        (ids[15:], 0, np.array([7])),
    ]
    batch = PrefillBatch.build(chunks, PAGE, model.config.max_seq_len, torch.device(DEVICE))
    host_slots = np.array([3, 1, 4])
    results = []
    for fused in (False, True):
        kv_run, pool_run = model.make_kv_pool(PAGES, PAGE), model.make_state_pool(5)
        kv_run.k.copy_(kv.k), kv_run.v.copy_(kv.v)
        pool_run.conv.copy_(pool.conv), pool_run.recurrent.copy_(pool.recurrent)
        states = StateInputs(
            pool_run,
            torch.from_numpy(host_slots).to(DEVICE),
            batch.seq_starts_host,
            host_slots,
            batch.starts == 0,
        )
        attention = _PrefillAttention(kv_run, batch, model.scale, fused)
        logits = model(batch.inputs._replace(states=states), attention, select=batch.last_index)
        results.append((logits.cpu(), kv_run, pool_run))
    (expected, kv_ref, pool_ref), (logits, kv_fused, pool_fused) = results
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(kv_fused.k.cpu(), kv_ref.k.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_fused.v.cpu(), kv_ref.v.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fused.conv.cpu(), pool_ref.conv.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_fused.recurrent.cpu(), pool_ref.recurrent.cpu(), atol=1e-4, rtol=1e-4)


class _HandOver(Stage):
    """A stage whose hidden states go to the next through a list in this process (between processes they go
    over torch.distributed: tests/test_e2e_hybrid_snapshots.py)."""

    def __init__(self, layers: LayerRange, handed: list[torch.Tensor]) -> None:
        super().__init__(layers, rank=int(not layers.first), stages=2)
        self.handed = handed

    def enter(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        (x,) = self.handed
        assert x.shape == (rows, hidden) and x.dtype == dtype
        return self.handed.pop()

    def hand_on(self, x: torch.Tensor) -> None:
        self.handed.append(x.clone())


@pytest.mark.parametrize(("fused", "tied"), [(False, False), (True, False), (True, True)])
def test_two_stages_equal_the_whole_model(fused: bool, tied: bool):
    """The layers split in two stages (the gated delta nets, then the full-attention layer: a stage with no KV
    layer, one with no state layer) give the whole model's logits and write its pools' layers, in torch ops and
    in the Triton kernels."""
    whole = _model(tied)  # tied: the last stage holds the embedding again, as its head
    inputs, kv, tables, lens = _decode_step(whole, batch=3)
    expected, kv_whole, pool_whole = _run(whole, inputs, kv, tables, lens, fused=False)
    handed: list[torch.Tensor] = []
    outputs = []
    for begin, end in ((0, 2), (2, 3)):
        layers = LayerRange(begin, end, 3)
        stage = Qwen35Model(whole.config, DEVICE, torch.float32, _HandOver(layers, handed))
        held = set(stage.state_dict())
        stage.load_state_dict(stage_weights(whole.state_dict(), layers, held))
        outputs.append(_run(stage, inputs, kv, tables, lens, fused, layers=(begin, end)))
    (first, kv_first, pool_first), (logits, kv_last, pool_last) = outputs
    assert first is None and not handed and kv_first.k.shape[0] == 0 and pool_last.conv.shape[0] == 0
    real = inputs.states.slots.cpu() != 0
    torch.testing.assert_close(logits.cpu()[real], expected.cpu()[real], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(kv_last.k[:, 1:], kv_whole.k[:, 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_first.recurrent, pool_whole.recurrent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool_first.conv, pool_whole.conv, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("fla")), reason="fla-core on a CUDA device"
)
def test_prefill_graph_replays_the_eager_prefill():
    """A bf16 hybrid's prefill replayed from its CUDA graph (fla's kernels; the batch padded to the bucket, the
    padding tokens one more sequence at the sink slot) gives the eager step's tokens and pools: a fresh sequence
    of two chunks and one continuing its state; the sink slot stays zero."""
    import dataclasses

    from executor_svc.prefill.graphs import PrefillGraphs
    from executor_svc.slot_store import GREEDY, SlotStore
    from protos.layout import RowLayout

    dims = {
        "linear_key_dim": 64,
        "linear_value_dim": 64,
        "head_dim": 64,
        "hidden_size": 64,
        "max_seq_len": 256,
    }
    model = Qwen35Model(dataclasses.replace(_model().config, **dims), "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    assert model.prefill_capturable
    ids = torch.randint(0, model.config.vocab_size, (77,), generator=g).numpy()
    chunks = [(ids[:70], 0, np.arange(1, 19)), (ids[70:], 5, np.array([19, 20, 21]))]
    layout = RowLayout.build([1, 2], model.config.max_seq_len, PAGE, 32)
    runs = []
    for buckets in ((128,), ()):
        kv, pool = model.make_kv_pool(32, PAGE), model.make_state_pool(5)
        generator = torch.Generator().manual_seed(5)
        for pages in (kv.k, kv.v, pool.conv, pool.recurrent):
            pages.copy_(torch.randn(pages.shape, generator=generator) * 0.3)
        pool.conv[:, 0], pool.recurrent[:, 0] = 0, 0
        store = SlotStore(layout, torch.device("cuda"), model.config.vocab_size)
        graphs = PrefillGraphs(
            model, kv, store, buckets, max_seq_len=model.config.max_seq_len, state_pool=pool
        )
        with torch.inference_mode():
            if buckets:
                assert graphs.states == {128: "captured"}
                sampled = graphs.launch(chunks, [1, 2], GREEDY, [3, 1])
            else:
                sampled = graphs._eager(chunks, [1, 2], GREEDY, [3, 1])
        assert sampled is not None
        runs.append((sampled[0].cpu(), kv, pool))
    (tokens, kv, pool), (expected, kv_eager, pool_eager) = runs
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(kv.k[:, 1:], kv_eager.k[:, 1:], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool.conv, pool_eager.conv, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool.recurrent, pool_eager.recurrent, atol=2e-2, rtol=2e-2)
    assert not pool.conv[:, 0].any() and not pool.recurrent[:, 0].any()
