"""Triton kernels of the resident decode step against the torch versions (SlotStore, reference attention,
the Llama model's ops), under TRITON_INTERPRET=1 on the CPU unless TRITON_INTERPRET=0 picks the GPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import interpreting, triton_available

if not triton_available():
    pytest.skip("triton cannot run here: no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from executor_svc.attention.torch_ref import decode_attention
from executor_svc.kernels.attention import decode_splits, paged_decode_attention
from executor_svc.kernels.controls import fused_logprob_table
from executor_svc.kernels.fused import rmsnorm_residual, rope_kv_write, silu_mul
from executor_svc.kernels.slot_ops import SamplerState, advance, gather_inputs, scatter_sampler
from executor_svc.kv_pool import KVPool
from executor_svc.models.layers import RMSNorm, rotate_half
from executor_svc.sampler_controls import SamplerControls, logprob_table
from executor_svc.slot_store import SlotStore
from protos.layout import RowLayout

DEVICE = torch.device("cpu" if interpreting() else "cuda")
LAYOUT = RowLayout(slots=9, block_span=8)  # B = 4, up to 8 pages a row
C, SPAN = LAYOUT.columns, LAYOUT.block_span
KV_LEN, POS_OFFSET, STATE_SLOT, BLOCK_TABLE = (
    RowLayout.KV_LEN,
    RowLayout.POS_OFFSET,
    RowLayout.STATE_SLOT,
    RowLayout.BLOCK_TABLE,
)
HEADS, KV_HEADS = 9, 3  # SmolLM2's GQA 3:1
POOL_PAGES = 20


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: tight. bfloat16: two ulps, since the interpreter's float32 -> bfloat16 cast truncates where
    the GPU (and torch) round to nearest; on the GPU the fused kernels round as torch does."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 4e-2, "rtol": 2**-6}


def filled_store(page_size: int, seed: int) -> SlotStore:
    """A store whose real rows hold random lengths, offsets and non-contiguous pages; row 0 stays zero."""
    gen = torch.Generator().manual_seed(seed)
    store = SlotStore(LAYOUT, DEVICE)
    rows = torch.zeros(LAYOUT.slots, C, dtype=torch.int32)
    for slot in range(1, LAYOUT.slots):
        rows[slot, KV_LEN] = int(torch.randint(0, SPAN * page_size, (1,), generator=gen))
        rows[slot, POS_OFFSET] = int(torch.randint(0, 5, (1,), generator=gen))
        rows[slot, STATE_SLOT] = slot
        rows[slot, BLOCK_TABLE:] = (torch.randperm(POOL_PAGES - 1, generator=gen)[:SPAN] + 1).to(torch.int32)
    store.rows.copy_(rows)
    store.last_token.copy_(torch.randint(1, 1000, (LAYOUT.slots,), generator=gen))
    store.last_token[0] = 0
    return store


def set_step(store: SlotStore, slots: list[int]) -> torch.Tensor:
    store.set_slots(np.array(slots, dtype=np.int32))
    return store.step_slots[: len(slots)]


def test_triton_is_available_only_where_it_can_run(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_available() == torch.cuda.is_available()


# --- tables ---------------------------------------------------------------------------------------


def sampler_state(store: SlotStore) -> SamplerState:
    return SamplerState(store.temperature, store.top_p, store.top_k, store.seed, store.last_token)


def test_scatter_sampler_matches_the_slot_stores_torch_writes():
    store = filled_store(16, 5)
    reference = SlotStore(LAYOUT, torch.device("cpu"))  # the torch writes, whatever DEVICE is
    reference.last_token.copy_(store.last_token.cpu())
    slots = np.array([3, 7, 1], dtype=np.int32)
    f32 = np.array([[0.7, 0.9], [0.0, 1.0], [1.3, 0.5]], dtype=np.float32)
    # Seeds whose low half has its top bit set and whose high half is negative; last_token -1 keeps slot 7's.
    i32 = np.array([[40, -5, -2, 17], [0, 123, 0, -1], [5, 2**31 - 1, 7, 0]], dtype=np.int32)
    reference.write_sampler(slots, f32, i32)
    words = np.concatenate([slots, f32.reshape(-1).view(np.int32), i32.reshape(-1)])
    scatter_sampler(torch.from_numpy(words).to(DEVICE), len(slots), sampler_state(store))
    for name in ("temperature", "top_p", "top_k", "seed", "last_token"):
        torch.testing.assert_close(
            getattr(store, name).cpu(), getattr(reference, name), rtol=0, atol=0, msg=name
        )
    assert int(store.seed[3]) == (-2 << 32) | (2**32 - 5)
    # A count of zero writes nothing, and a slot outside [1, S) is dropped (the sink stays greedy, zero).
    before = [t.clone() for t in sampler_state(store)]
    scatter_sampler(torch.from_numpy(words).to(DEVICE), 0, sampler_state(store))
    outside = np.concatenate([[0, LAYOUT.slots], np.ones(4, np.float32).view(np.int32), np.ones(8, np.int32)])
    scatter_sampler(torch.from_numpy(outside.astype(np.int32)).to(DEVICE), 2, sampler_state(store))
    for name, after, was in zip(SamplerState._fields, sampler_state(store), before):
        torch.testing.assert_close(after, was, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("page_size", [4, 16])
def test_gather_inputs_matches_the_slot_store(page_size: int):
    store = filled_store(page_size, 2 + page_size)
    store.rows[6, KV_LEN] = page_size  # exactly at a page crossing: the write goes to the second page
    store.rows[7, KV_LEN] = 0
    slots = set_step(store, [6, 0, 3, 7])  # slot 0 = a padding row
    context = SPAN * page_size + 5  # room for every row's length and offset
    got = gather_inputs(store.rows, slots, store.last_token, page_size, context)
    expected = store.gather(4)
    for name in ("tokens", "positions", "kv_lens"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=0, msg=name)
    # Past a shorter context, positions stay at the tables' last (a bad row, or steady steps run too long).
    short = gather_inputs(store.rows, slots, store.last_token, page_size, 3)
    torch.testing.assert_close(short.positions, expected.positions.clamp(max=2), rtol=0, atol=0)
    # As the torch decode (TorchDecode) places the step's K/V.
    kv_lens = expected.kv_lens
    write_page = expected.block_tables.gather(1, (kv_lens // page_size).long()[:, None])[:, 0]
    torch.testing.assert_close(got.write_page, write_page, rtol=0, atol=0)
    torch.testing.assert_close(got.write_offset, kv_lens % page_size, rtol=0, atol=0)
    assert got.write_page[1] == 0 and got.tokens[1] == 0 and got.positions[1] == 0  # padding: the sink


def test_advance_adds_one_to_real_rows_only():
    store, expected = filled_store(16, 3), filled_store(16, 3)
    for s in (store, expected):
        set_step(s, [4, 0, 2, 0])
    advance(store.rows, store.step_slots[:4])
    expected.advance(4)
    torch.testing.assert_close(store.rows, expected.rows, rtol=0, atol=0)
    assert int(store.rows[0].abs().sum()) == 0


# --- attention ------------------------------------------------------------------------------------


def attention_case(page_size: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A store with lengths that cross pages and fill the span, a random pool (sink page included), q."""
    gen = torch.Generator().manual_seed(seed)
    store = filled_store(page_size, seed)
    store.rows[3, KV_LEN] = SPAN * page_size - 1  # the whole span once the step's token counts
    store.rows[5, KV_LEN] = page_size  # the step's token opens a new page
    store.rows[7, KV_LEN] = 0  # only the step's token
    slots = set_step(store, [3, 0, 5, 7])
    shape = (POOL_PAGES, page_size, KV_HEADS, head_dim)
    k_layer = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_layer = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(4, HEADS, head_dim, generator=gen).to(dtype).to(DEVICE)
    return store, slots, q, k_layer, v_layer


def reference_attention(store: SlotStore, q, k_layer, v_layer, scale: float) -> torch.Tensor:
    inputs = store.gather(q.shape[0])
    return decode_attention(
        q.float().cpu(),
        k_layer.float().cpu(),
        v_layer.float().cpu(),
        inputs.block_tables.cpu(),
        (inputs.kv_lens + 1).cpu(),
        scale,
    )


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_decode_attention_matches_the_reference(page_size: int, head_dim: int, splits: int):
    store, slots, q, k_layer, v_layer = attention_case(
        page_size, head_dim, torch.float32, page_size + head_dim
    )
    scale = head_dim**-0.5
    counters = torch.zeros(4 * KV_HEADS + 1, dtype=torch.int32, device=DEVICE)
    expected = reference_attention(store, q, k_layer, v_layer, scale)
    for _ in range(2):  # the same counters serve the next launch: the kernel leaves them zero
        got = paged_decode_attention(
            q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, page_size, scale, splits, counters
        )
        torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)
        assert not counters.any()


def test_split_wide_heads_take_32_token_steps():
    from executor_svc.kernels.attention import _tokens_per_step

    assert _tokens_per_step(16, 256, 8) == 32 and _tokens_per_step(4, 512, 2) == 32
    assert (
        _tokens_per_step(16, 256, 1) == 64 and _tokens_per_step(16, 128, 8) == 64
    )  # unsplit; narrower heads
    assert _tokens_per_step(64, 256, 8) == 64  # never less than a page


@pytest.mark.parametrize("launch", [(16, 8, None, None), (32, 2, None, 2)])
def test_paged_decode_attention_by_another_launch(launch: tuple[int, int, None, int | None]):
    """Other tokens an inner step, warps and stages (what bench/decode_attention.py times) give the same
    attention; fewer tokens than a page are refused."""
    store, slots, q, k_layer, v_layer = attention_case(16, 64, torch.float32, 40)
    expected = reference_attention(store, q, k_layer, v_layer, 0.125)
    got = paged_decode_attention(
        q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 16, 0.125, 2, None, launch
    )
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="at least a page"):
        paged_decode_attention(
            q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 16, 0.125, 2, None, (8, 4, None, None)
        )


def test_the_combine_reads_the_partitions_in_blocks_where_they_do_not_fit_at_once(monkeypatch):
    from executor_svc.kernels import attention

    store, slots, q, k_layer, v_layer = attention_case(4, 64, torch.float32, 60)
    group = 4  # SmolLM2's three query heads a KV head, padded to a power of two
    monkeypatch.setattr(attention, "_COMBINE_ELEMENTS", 2 * group * 64)  # two partitions a load, of five
    assert attention._split_block(5, HEADS // KV_HEADS, 64) == 2
    got = paged_decode_attention(q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 4, 0.125, 5)
    expected = reference_attention(store, q, k_layer, v_layer, 0.125)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_attention_in_half_precision(dtype: torch.dtype):
    store, slots, q, k_layer, v_layer = attention_case(16, 64, dtype, 11)
    got = paged_decode_attention(q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 16, 0.125, 2)
    assert got.dtype == dtype
    expected = reference_attention(store, q, k_layer, v_layer, 0.125)
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_padding_rows_attend_to_the_sink_position_and_stay_finite():
    store, slots, q, k_layer, v_layer = attention_case(4, 64, torch.float32, 5)
    slots = set_step(store, [0, 0, 0, 0])
    k_layer[0] = 1e4  # whatever padding rows wrote there: large, but finite
    got = paged_decode_attention(q * 100, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 4, 0.125, 3)
    assert torch.isfinite(got).all()
    # Softmax over one position is that position's V, per KV head of each query head.
    sink_v = v_layer[0, 0].repeat_interleave(HEADS // KV_HEADS, dim=0)  # [HEADS, D]
    torch.testing.assert_close(got, sink_v.expand_as(got), atol=1e-6, rtol=1e-6)


def test_split_count_follows_occupancy_and_length():
    # One row of SmolLM2 over 8k tokens on 132 SMs: split; a wide bucket already fills the GPU.
    assert decode_splits(1, 3, 8192, 16, 132) == 64  # the cap
    assert decode_splits(64, 3, 8192, 16, 132) == 1
    assert decode_splits(1, 3, 128, 16, 132) == 2  # a partition is at least one inner step (64 tokens)
    assert 1 < decode_splits(16, 3, 8192, 16, 132) < 64


# --- fused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_residual_matches_the_model_norm(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    hidden, eps = 576, 1e-5
    x, residual = (torch.randn(3, hidden, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    norm = RMSNorm(hidden, eps, DEVICE, dtype)
    norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    tol = tolerance(dtype)
    normed, new_residual = rmsnorm_residual(x, residual, norm.weight, eps)
    torch.testing.assert_close(new_residual, x + residual, **tol)
    torch.testing.assert_close(normed, norm(x + residual), **tol)
    normed, same = rmsnorm_residual(x, None, norm.weight, eps)
    assert same is x
    torch.testing.assert_close(normed, norm(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_kv_write_matches_the_model_rotation_and_pool_write(head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(head_dim)
    batch, page_size, max_seq_len = 4, 4, 32
    # The model's rope tables (DenseModel's arithmetic, theta as SmolLM2's).
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)  # angles: [max_seq_len, head_dim]
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    # q, k, v as views of one fused projection, as a fused qkv matmul would leave them.
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=1)
    q, k, v = (
        q.view(batch, HEADS, head_dim),
        k.view(batch, KV_HEADS, head_dim),
        v.view(batch, KV_HEADS, head_dim),
    )
    positions = torch.tensor([7, 0, 31, 12], device=DEVICE)
    write_page = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    write_offset = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    expected_pool = KVPool(1, 6, page_size, KV_HEADS, head_dim, dtype, DEVICE)
    pool = KVPool(1, 6, page_size, KV_HEADS, head_dim, dtype, DEVICE)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    expected_q = q * c + rotate_half(q) * s
    expected_k = k * c + rotate_half(k) * s
    expected_pool.write(0, write_page, write_offset, expected_k, v)
    k_before, v_before = k.clone(), v.clone()

    got = rope_kv_write(q, k, v, positions, cos, sin, pool.k[0], pool.v[0], write_page, write_offset)
    assert got.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(q, expected_q, **tolerance(dtype))
    torch.testing.assert_close(pool.k, expected_pool.k, **tolerance(dtype))
    torch.testing.assert_close(pool.v, expected_pool.v, rtol=0, atol=0)
    torch.testing.assert_close(k, k_before, rtol=0, atol=0)
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(4)
    intermediate = 1536  # two blocks, the second one partly masked
    gate_up = (torch.randn(3, 2 * intermediate, generator=gen) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **tolerance(dtype))


def test_paged_decode_attention_refuses_short_or_mistyped_counters():
    store, slots, q, k_layer, v_layer = attention_case(4, 64, torch.float32, 5)
    for counters in (torch.zeros(3, dtype=torch.int32), torch.zeros(12, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"counters must be int32\[>= 12\]"):
            paged_decode_attention(
                q, k_layer, v_layer, store.rows, slots, BLOCK_TABLE, 4, 0.125, 2, counters.to(DEVICE)
            )


def test_controls_adjust_kernel_equals_the_torch_rules():
    """Bias, penalties, stop ids below min_tokens and the grammar mask in one kernel: equal to the torch form
    for rows on and off, over a vocabulary that is not a multiple of the block or of 32."""
    slots_n, vocab = 5, 1500
    generator = torch.Generator().manual_seed(0)
    controls = SamplerControls(slots_n, vocab, DEVICE)
    controls.on.copy_(torch.tensor([False, True, True, False, True]))
    controls.bias.copy_(torch.randn(slots_n, vocab, generator=generator))
    controls.seen.copy_(torch.rand(slots_n, vocab, generator=generator) < 0.3)
    controls.counts.copy_(torch.randint(0, 3, (slots_n, vocab), generator=generator, dtype=torch.int32))
    controls.stop.copy_(torch.rand(slots_n, vocab, generator=generator) < 0.01)
    words = torch.randint(-(2**31), 2**31 - 1, controls.grammar_mask.shape, generator=generator)
    controls.grammar_mask.copy_(words.to(torch.int32))
    controls.grammar_mask[2] = -1  # a slot without a grammar: every token allowed
    controls.repetition.copy_(torch.tensor([1.0, 1.3, 0.8, 1.0, 1.1]))
    controls.frequency.copy_(torch.tensor([0.0, 0.4, -0.2, 0.0, 0.1]))
    controls.presence.copy_(torch.tensor([0.0, 0.7, 0.3, 0.0, -0.5]))
    controls.generated.copy_(torch.tensor([0, 2, 9, 0, 1], dtype=torch.int32))
    controls.min_tokens.copy_(torch.tensor([0, 4, 4, 0, 0], dtype=torch.int32))
    logits = (torch.randn(6, vocab, generator=generator) * 4).to(DEVICE)
    slots = torch.tensor([1, 2, 0, 4, 2, 3], device=DEVICE)
    want = controls._apply_torch(logits, slots)
    controls.fused = True
    got = controls.apply(logits, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got[2], logits[2]) and torch.isinf(got[0]).any()  # off untouched; stop/grammar masked


def test_count_inputs_kernel_equals_the_torch_counts():
    """The step's input tokens counted for the rows whose slot has controls, the sink's padding rows not."""
    counted = []
    for fused in (False, True):
        controls = SamplerControls(5, 100, DEVICE)
        controls.fused = fused
        controls.on.copy_(torch.tensor([False, True, True, False, True]))
        slots = torch.tensor([1, 2, 0, 4, 0, 3], device=DEVICE)
        for tokens in ([7, 99, 5, 0, 5, 3], [7, 1, 5, 0, 5, 3]):
            controls.count_inputs(slots, torch.tensor(tokens, device=DEVICE))
        counted.append((controls.counts.clone(), controls.seen.clone(), controls.generated.clone()))
    for want, got in zip(*counted, strict=True):
        assert torch.equal(got, want)
    assert int(counted[1][0][1, 7]) == 2 and int(counted[1][0][0].sum()) == 0


@pytest.mark.parametrize("vocab", [1500, 12, 3000])
def test_fused_logprob_table_equals_log_softmax_and_topk(vocab):
    """Each row's chosen token's logprob and the 20 best with their ids (the best first), from the blocks'
    partials; under 20 tokens the rest -inf with id 0, as the torch table pads."""
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, vocab, generator=generator) * 5).to(DEVICE)
    tokens = torch.randint(0, vocab, (5,), generator=generator).to(DEVICE)
    if vocab == 3000:  # a block all -inf (a model masking its padded ids): finite, not NaN
        logits[:, :1024] = float("-inf")
        tokens = tokens.clamp(min=1024)
    want = logprob_table(logits, tokens)
    got = fused_logprob_table(logits, tokens, 20)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert torch.equal(got[:, 21:], want[:, 21:])  # the same ids, in the same order
