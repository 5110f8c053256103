"""The torch reference of the gated delta net's stateful ops equals transformers' own torch implementation
(modeling_qwen3_5's fallbacks), from a given state and from zeros, and a sequence split in chunks equals it
read whole; the state pool's copies and its sink."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.kernels import gated_delta_ref as ref
from executor_svc.kernels import interpreting
from executor_svc.state_pool import StatePool

T, HK, H, DK, DV, C, K = 150, 2, 4, 16, 8, 24, 4  # T spans three blocks of the chunked rule, the last partial


@pytest.fixture(scope="module")
def hf():
    from tests.torch_only import qwen3_5_modeling

    return qwen3_5_modeling()


def _heads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k repeated to the value heads, as the model does before transformers' rule (older releases'
    torch rule takes as many key heads as value heads)."""
    return q.repeat_interleave(H // HK, dim=2), k.repeat_interleave(H // HK, dim=2)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, HK, DK, generator=g), torch.randn(1, T, HK, DK, generator=g)
    v = torch.randn(1, T, H, DV, generator=g)
    decay, beta = -torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g)
    return q, k, v, decay, beta, torch.randn(1, H, DK, DV, generator=g)


@pytest.mark.parametrize("from_zeros", [False, True])
def test_sequence_equals_transformers_chunked(hf, from_zeros):
    q, k, v, g, beta, state = _inputs()
    initial = None if from_zeros else state
    expected, final = hf.torch_chunk_gated_delta_rule(
        *_heads(q, k),
        v,
        g,
        beta,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    # ours value-major ([H, Dv, Dk], the pool's), transformers' key-major
    initial = None if from_zeros else state[0].transpose(-1, -2)
    out, got = ref.delta_rule_sequence(q[0], k[0], v[0], g[0], beta[0], initial)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.transpose(-1, -2), final[0], atol=1e-5, rtol=1e-5)


def test_steps_equal_transformers_recurrent(hf):
    q, k, v, g, beta, state = _inputs(1)
    expected, final = hf.torch_recurrent_gated_delta_rule(
        *_heads(q, k), v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    outs, state = [], state.transpose(-1, -2)  # ours value-major, transformers' key-major
    for t in range(T):
        out, state = ref.delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 1), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.transpose(-1, -2), final, atol=1e-5, rtol=1e-5)


def test_chunks_continue_the_state():
    q, k, v, g, beta, _ = _inputs(2)
    whole, final = ref.delta_rule_sequence(q[0], k[0], v[0], g[0], beta[0], None)
    first, state = ref.delta_rule_sequence(q[0, :70], k[0, :70], v[0, :70], g[0, :70], beta[0, :70], None)
    rest, state = ref.delta_rule_sequence(q[0, 70:], k[0, 70:], v[0, 70:], g[0, 70:], beta[0, 70:], state)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


def test_conv_equals_transformers(hf):
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(1, C, T, generator=g), torch.randn(C, K, generator=g)
    expected = hf.causal_conv1d_fn(x, weight, None, activation="silu")[0].t()
    first, window = ref.conv1d_sequence(x[0, :, :100].t(), weight, None)
    rest, window = ref.conv1d_sequence(x[0, :, 100:].t(), weight, window)
    torch.testing.assert_close(torch.cat([first, rest]), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(window, x[0, :, -(K - 1) :])
    # one token of two sequences: transformers' update kernel, which updates its state in place
    states, token = torch.randn(2, C, K - 1, generator=g), torch.randn(2, C, 1, generator=g)
    theirs = states.clone()
    expected = hf.causal_conv1d_update(token, theirs, weight, None, activation="silu")[:, :, 0]
    out, window = ref.conv1d_step(token[:, :, 0], weight, states)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(window, theirs)


def test_state_pool_copies_and_sizes():
    pool = StatePool(2, 4, C, K, H, DK, DV, dtype=torch.float32, device="cpu")
    assert pool.nbytes == 2 * 4 * (C * (K - 1) + H * DK * DV) * 4
    assert pool.slot_nbytes * pool.num_slots == pool.nbytes
    pool.conv[:, 1] = 1.0
    pool.recurrent[:, 1] = 2.0
    pool.copy(np.array([[1, 3]]))
    assert (pool.conv[:, 3] == 1.0).all() and (pool.recurrent[:, 3] == 2.0).all()
    assert (pool.conv[:, 0] == 0).all() and (pool.recurrent[:, 2] == 0).all()
    with pytest.raises(ValueError, match="sink"):
        StatePool(2, 1, C, K, H, DK, DV, dtype=torch.float32, device="cpu")


@pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)
@pytest.mark.parametrize("dtype, block", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 32)])
def test_step_at_slots_equals_the_reference(dtype, block):
    """gated_delta_slots' Triton kernel, the GPU's decode step, updates the pool's states in place at each row's
    slot as the reference's gather, step and scatter do; a padding row (slot 0) leaves the sink zero. DV = 20
    spans three value blocks of 8, the last partial (or one of 32); DK = 12 is not a power of two. On CUDA where
    not interpreting."""
    from executor_svc.kernels import gated_delta_slots

    dk, dv = 12, 20
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([3, 0, 1, 5])  # distinct; row 1 is padding
    n = len(slots)
    # q | k | v of each row in one tensor, as the model splits them
    mixed = torch.randn(n, 2 * HK * dk + H * dv, generator=g).to(dtype)
    q, k, v = mixed.split([HK * dk, HK * dk, H * dv], dim=-1)
    q, k, v = q.view(n, HK, dk), k.view(n, HK, dk), v.view(n, H, dv)
    decay, beta = -torch.rand(n, H, generator=g), torch.rand(n, H, generator=g).to(dtype)
    states = torch.randn(6, H, dv, dk, generator=g)  # value-major, as the pool's
    states[0] = 0
    expected_states = states.clone()
    expected = ref.delta_rule_step_at_slots(q, k, v, decay, beta, expected_states, slots)
    device = "cpu" if interpreting() else "cuda"
    q, k, v, decay, beta, states, slots = (x.to(device) for x in (q, k, v, decay, beta, states, slots))
    out = gated_delta_slots.delta_rule_step_at_slots(q, k, v, decay, beta, states, slots, block=block).cpu()
    states, real = states.cpu(), slots.cpu() != 0
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)
    assert (states[0] == 0).all() and (states[[2, 4]] == expected_states[[2, 4]]).all()


def _check_packed_conv(starts, host_slots, fresh, dtype, shape=None, **tiles) -> None:
    """conv_qkv then conv_windows (with `tiles`: block_tokens, warps) on sequences [starts[i], starts[i + 1]) at
    host_slots[i] (fresh[i]: from zeros, whatever the slot holds) equal conv1d_sequence run sequence by
    sequence, q and k l2-normed; each window moved on in place at its slot, the other slots untouched. x's rows
    strided, as the model's joined projection gives them. `shape` (tokens, sequences) pads to a graph's: the
    padding tokens (a sequence at the sink slot) leave the sink's window zero."""
    from executor_svc.kernels.gated_delta_conv import conv_qkv, conv_windows
    from executor_svc.kernels.gated_delta_fla import Packed

    hk, dk, hv, dv = 2, 8, 3, 4  # DV narrower than DK: the v heads' programs mask
    channels = 2 * hk * dk + hv * dv
    real = starts[-1]
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(shape[0] if shape else real, channels + 5, generator=g).to(dtype)  # past real: padding
    x, weight = wide[:, :channels], torch.randn(channels, K, generator=g).to(dtype)
    windows = torch.randn(max(host_slots) + 1, channels, K - 1, generator=g).to(dtype)
    windows[0] = 0  # the sink's
    expected_windows, expected = windows.clone(), []
    for i, slot in enumerate(host_slots):
        part = x[starts[i] : starts[i + 1]]
        out, expected_windows[slot] = ref.conv1d_sequence(part, weight, None if fresh[i] else windows[slot])
        expected.append(out)
    q, k, v = torch.cat(expected).split([hk * dk, hk * dk, hv * dv], dim=-1)
    device = "cpu" if interpreting() else "cuda"
    x, weight, windows = wide.to(device)[:, :channels], weight.to(device), windows.to(device)
    packed = Packed.build(starts, fresh, host_slots, torch.device(device), shape)
    outs = conv_qkv(x, weight, windows, packed, (hk, dk, hv, dv), **tiles)
    conv_windows(x, windows, packed)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    qk_expected = (ref.l2norm(t.float().view(-1, hk, dk)).to(dtype) for t in (q, k))
    for got, want in zip(outs, (*qk_expected, v.view(-1, hv, dv)), strict=True):
        torch.testing.assert_close(got[:real].cpu().float(), want.float(), **tolerance)
    torch.testing.assert_close(windows.cpu(), expected_windows)


@pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)
@pytest.mark.parametrize(
    ("dtype", "padded"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_packed_conv_equals_the_conv_by_sequence(dtype, padded):
    """gated_delta_conv's kernels (the CUDA prefill's conv) at their defaults: continued and fresh windows, a
    sequence of one token, windows that reach back past a short sequence, one of two chunks; padded, room for
    six sequences: the 225 padding tokens two at the sink (128 and 97), then two of none."""
    starts = np.array([0, 2, 3, 5, 75])
    host_slots, fresh = np.array([4, 1, 5, 2]), np.array([False, True, False, False])
    _check_packed_conv(starts, host_slots, fresh, dtype, (300, 6) if padded else None)


@pytest.mark.parametrize(
    ("starts", "tokens", "spare", "cuts"),
    [
        (np.arange(0, 5633, 512), 8192, 54, np.arange(6144, 8192, 512)),  # 11 prompts of 512 in 8,192
        (np.array([0, 100]), 1000, 2, np.array([612])),  # two spare: pieces of 512 and 388
        (np.array([0, 3, 10]), 700, 11, np.arange(74, 700, 64)),  # never under a chunk
        (np.array([0, 3, 10]), 700, 9, np.arange(138, 700, 128)),  # fewer spare: longer pieces
        (np.array([0, 512]), 512, 3, np.array([], dtype=np.int64)),  # no padding
    ],
)
def test_padding_starts_cut_the_padding_into_short_sequences(starts, tokens, spare, cuts):
    """A graph's padding tokens in whole-chunk pieces, none of more chunks than the longest prompt where the spare
    sequences allow, so fla's state pass walks no more chunks in series than the prompts need."""
    from executor_svc.kernels.gated_delta_fla import padding_starts

    got = padding_starts(starts, tokens, spare)
    assert np.array_equal(got, cuts) and len(got) < max(spare, 1)


def test_packed_padding_sequences_sit_at_the_sink():
    """A padded Packed: the real sequences, then the padding pieces fresh at the sink slot, then sequences of
    none; every chunk of every sequence indexed once, the spare chunk entries at the last (empty) one."""
    from executor_svc.kernels.gated_delta_fla import CHUNK, Packed

    starts, tokens, sequences = np.array([0, 100, 612]), 2048, 8
    packed = Packed.build(
        starts, np.array([True, False]), np.array([3, 4]), torch.device("cpu"), (tokens, sequences)
    )
    cu = packed.cu_seqlens.tolist()
    assert cu == [0, 100, 612, 1124, 1636, 2048, 2048, 2048, 2048, 2048, 2048]
    assert packed.slots.tolist() == [3, 4] + [0] * 8 and packed.kept.tolist() == [0, 1] + [0] * 8
    lengths = np.diff(cu)
    chunks = packed.chunk_indices.tolist()
    real = [[i, c] for i, n in enumerate(lengths) for c in range(-(-n // CHUNK))]
    assert chunks[: len(real)] == real and all(chunk == [9, 0] for chunk in chunks[len(real) :])
    assert len(chunks) == -(-tokens // CHUNK) + len(lengths)


@pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_tokens", [16, 32, 64])  # every one conv_qkv takes
def test_packed_conv_in_blocks_of_a_chunk(block_tokens, dtype):
    """The packed conv in programs of block_tokens, each a block of one of fla's chunks, on lengths that no
    block size divides: continued windows reached back into by a one-token sequence, one of WIDTH - 1 tokens
    and longer ones (whose later blocks must not), a fresh sequence over two chunks, then padding to a graph's
    shape (its tokens a sequence at the sink, then sequences of none)."""
    starts = np.array([0, 37, 38, 41, 111, 160])  # 37, 1, 3, 70 and 49 tokens
    host_slots, fresh = np.array([3, 1, 6, 2, 5]), np.array([False, False, False, True, False])
    _check_packed_conv(starts, host_slots, fresh, dtype, (176, 7), block_tokens=block_tokens)


@pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)
@pytest.mark.parametrize(
    ("tiles", "width", "message"),
    [
        ({"block_tokens": 8}, K, "block_tokens must be one of"),
        ({"block_tokens": 48}, K, "block_tokens must be one of"),
        ({"warps": 3}, K, "warps must be one of"),
        ({"warps": 16}, K, "warps must be one of"),
        ({"block_tokens": 16}, 18, "reaches back past a block of 16 tokens"),
    ],
)
def test_packed_conv_refuses_other_tiles(tiles, width, message):
    """conv_qkv takes the block sizes that divide fla's chunk and reach its window, on 1 to 8 warps."""
    from executor_svc.kernels.gated_delta_conv import conv_qkv
    from executor_svc.kernels.gated_delta_fla import Packed

    channels = 2 * 2 * 8 + 3 * 4
    packed = Packed.build(np.array([0, 5]), np.array([False]), np.array([1]), torch.device("cpu"))
    x, weight = torch.zeros(5, channels), torch.zeros(channels, width)
    with pytest.raises(ValueError, match=message):
        conv_qkv(x, weight, torch.zeros(2, channels, width - 1), packed, (2, 8, 3, 4), **tiles)


@pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)
def test_state_moves_gather_and_scatter_by_slot():
    """The CUDA prefill's states out of the pool and back (state_moves): each sequence's state at its slot, zeros
    for a fresh one whatever its slot holds; the final states back at their slots, padding sequences' (at the
    sink) not written, so the sink stays zero and slots of no sequence keep theirs."""
    from executor_svc.kernels.gated_delta_fla import Packed
    from executor_svc.kernels.state_moves import gather_states, scatter_states

    device = "cpu" if interpreting() else "cuda"
    g = torch.Generator().manual_seed(8)
    pool = torch.randn(7, H, DV, DK, generator=g)  # 1,280 values a state: a partial block of 2,048
    pool[0] = 0
    host_slots, fresh = np.array([4, 1, 5, 2]), np.array([False, True, False, False])
    starts = np.array([0, 3, 9, 10, 20])
    packed = Packed.build(starts, fresh, host_slots, torch.device(device), (32, 6))  # padded: two at the sink
    on = pool.to(device)
    initial = gather_states(on, packed).cpu()
    assert initial.shape == (8, H, DV, DK)
    expected = pool[packed.slots.cpu()] * packed.kept.cpu()[:, None, None, None]
    assert torch.equal(initial, expected) and (initial[1] == 0).all()
    final = torch.randn(8, H, DV, DK, generator=g)
    scatter_states(final.to(device), on, packed)
    want = pool.clone()
    want[torch.from_numpy(host_slots)] = final[:4]
    assert torch.equal(on.cpu(), want)
    # A strided pool (a view across layers' slots) would be read at the wrong places: refused, nothing moved.
    strided = on.transpose(2, 3)
    for move in (
        lambda: gather_states(strided, packed),
        lambda: scatter_states(final.to(device), strided, packed),
    ):
        with pytest.raises(ValueError, match="pool .*contiguous"):
            move()
    assert torch.equal(on.cpu(), want)
