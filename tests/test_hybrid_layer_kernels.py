"""The Qwen3.5 hybrid's kernels alone: the gated attention's norm, rope, KV write and output gate in blocks of
rows equal a row a program (and torch), their launch overrides checked; the gated delta net's one-kernel
decode equals the kernels it joins, and a step takes the measured ones; the conv step at slots equals the
reference step; fla's prefill equals the reference's by sequence. Under Triton's interpreter on the CPU,
or on CUDA."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from executor_svc.kernels import gated_delta_ref as ref
from executor_svc.kernels import interpreting
from executor_svc.state_pool import StateInputs
from tests.hybrid_kernel_shapes import DEVICE, PAGE, PAGES

pytestmark = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="Triton: its interpreter or a CUDA device"
)


def test_a_decode_step_takes_the_measured_delta_net_kernels():
    from executor_svc.kernels.gated_delta_joined import joined_step_wins
    from executor_svc.kernels.gated_delta_slots import value_block

    # Qwen3.5-0.8B's 16 value heads of 128 dims: one kernel at one row only, then the three with rule tiles of 8
    # values up to 64 rows, wider past them
    assert joined_step_wins(1, 16) and not joined_step_wins(2, 16)
    assert [value_block(rows, 16, 128) for rows in (2, 16, 64, 128, 256)] == [8, 8, 8, 16, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_attention_kernels_in_blocks_of_rows_equal_a_row_a_program(dtype: torch.dtype):
    """norm_rope_kv_write and output_gate over 11 rows in blocks of 4 (the last of 3) and in one block of 16
    give what they give a row a program (the decode step's launch), bit for bit under the interpreter: q, the
    K and V written at each row's page and offset, the pool elsewhere untouched, the gated output; and that
    equals the torch model's norm, partial rope and gate. Rows strided in mixed, positions and pool slots
    scattered."""
    from executor_svc.kernels.gated_attention import norm_rope_kv_write, output_gate
    from executor_svc.models.qwen3_5_model import rope_partial

    heads, kv_heads, d, rot, rows, eps = 4, 2, 32, 8, 11, 1e-6
    g = torch.Generator().manual_seed(5)
    width = 2 * (heads + kv_heads) * d
    mixed = torch.randn(rows, width + 6, generator=g).to(dtype)[:, :width]
    q_norm, k_norm = (1 + 0.3 * torch.randn(d, generator=g) for _ in range(2))
    angles = torch.rand(40, rot // 2, generator=g) * 6.3
    angles = torch.cat((angles, angles), dim=-1)  # as the model's tables: [max_seq_len, rotary_dim]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 40, (rows,), generator=g)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:rows]
    write_page, write_offset = (slots // PAGE).int(), (slots % PAGE).int()
    attended = torch.randn(rows, heads, d, generator=g).to(dtype)  # the attention's output

    def run(rows_per_program: int) -> tuple[torch.Tensor, ...]:
        pools = torch.randn(2, PAGES, PAGE, kv_heads, d, generator=torch.Generator().manual_seed(6)).to(dtype)
        k_pool, v_pool = pools.to(DEVICE)
        on = [t.to(DEVICE) for t in (mixed, q_norm, k_norm, cos, sin, positions, write_page, write_offset)]
        launch = {"rows_per_program": rows_per_program}
        q = norm_rope_kv_write(*on[:3], eps, *on[3:6], k_pool, v_pool, *on[6:], heads, **launch)
        gated = output_gate(attended.to(DEVICE), on[0], **launch)
        return q.cpu(), k_pool.cpu(), v_pool.cpu(), gated.cpu(), pools

    # bf16: a unit in the last place from torch's (the interpreter rounds to bf16 toward zero, and the norm's
    # sum of squares adds up in another order than torch's), and rope's sum of two such products as far
    tolerance = {} if dtype == torch.float32 else {"atol": 2**-4, "rtol": 2**-7}
    expected = run(1)
    for rows_per_program in (4, 16):
        q, k_pool, v_pool, gated, _ = run(rows_per_program)
        assert torch.equal(v_pool, expected[2]) and torch.equal(gated, expected[3])
        # The interpreter sums every row's squares alike; a GPU in its tile's layout's order (a row over 4
        # warps, or within one), which can move a q or k value a unit in the last place
        same = {"atol": 0, "rtol": 0} if interpreting() else tolerance
        torch.testing.assert_close(q, expected[0], **same)
        torch.testing.assert_close(k_pool, expected[1], **same)

    q, k_pool, v_pool, gated, pools = expected
    query_gate, k, v = mixed.split([2 * heads * d, kv_heads * d, kv_heads * d], dim=-1)
    query_gate = query_gate.reshape(rows, heads, 2 * d)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # as OffsetRMSNorm, weight 1 + w
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        return rope_partial(x, cos[positions][:, None], sin[positions][:, None])

    torch.testing.assert_close(q, rope(norm(query_gate[..., :d], q_norm)), **tolerance)
    expected_k, expected_v = pools[0].clone(), pools[1].clone()
    expected_k[slots // PAGE, slots % PAGE] = rope(norm(k.reshape(rows, kv_heads, d), k_norm))
    expected_v[slots // PAGE, slots % PAGE] = v.reshape(rows, kv_heads, d)
    torch.testing.assert_close(k_pool, expected_k, **tolerance)
    assert torch.equal(v_pool, expected_v)
    torch.testing.assert_close(gated, attended.flatten(1) * torch.sigmoid(query_gate[..., d:].flatten(1)))


def test_gated_attention_launch_overrides_are_checked():
    from executor_svc.kernels.gated_attention import output_gate

    out, mixed = torch.zeros(2, 1, 4, device=DEVICE), torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two, got 3"):
        output_gate(out, mixed, rows_per_program=3)
    with pytest.raises(ValueError, match="warps must be a power of two up to 32, got 6"):
        output_gate(out, mixed, warps=6)


@pytest.mark.parametrize(
    ("dtype", "tile"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, (8, 1)), (torch.float32, (32, 4))],
)
def test_delta_net_step_equals_the_unfused_step(dtype: torch.dtype, tile: tuple[int, int] | None):
    """A gated delta net layer's decode in one kernel (delta_net_step_at_slots) equals the reference's conv step,
    gated_delta_slots' rule step and the gated norm kernel it joins: the output, the windows and states moved on
    at each row's slot; its arrival counters left zero. Two value heads a key head, which the last of their
    programs to finish norms; Dk = 12 and Dv = 20 not powers of two (blocks of 8: three programs a head, the last
    partial; or one of 32); rows strided in the joined projection. The padding row (slot 0) leaves the sink's window and state zero, slots not in the step keep
    theirs."""
    from executor_svc.kernels.fused import gated_rmsnorm
    from executor_svc.kernels.gated_delta_joined import delta_net_step_at_slots
    from executor_svc.kernels.gated_delta_slots import delta_rule_step_at_slots

    hk, h, dk, dv, width = 2, 4, 12, 20, 4
    channels = 2 * hk * dk + h * dv
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([3, 0, 1, 5])
    n = len(slots)
    # x | z | b | a of each row in one tensor, as the joined projection gives them
    mixed = torch.randn(n, channels + h * dv + 2 * h, generator=g).to(dtype)
    x, z, b, a = mixed.split([channels, h * dv, h, h], dim=-1)
    weight = (torch.randn(channels, width, generator=g) * 0.5).to(dtype)
    gates = -torch.rand(h, generator=g) * 4, torch.randn(h, generator=g)
    norm_weight = torch.randn(dv, generator=g).to(dtype)
    windows = torch.randn(6, channels, width - 1, generator=g).to(dtype)
    states = torch.randn(6, h, dv, dk, generator=g) * 0.3  # value-major, as the pool's
    windows[0], states[0] = 0, 0
    expected_windows, expected_states = windows.clone(), states.clone().to(DEVICE)
    conv, moved = ref.conv1d_step(x, weight, windows[slots])
    real = slots != 0
    expected_windows[slots[real]] = moved[real]
    on = [t.clone().to(DEVICE) for t in (mixed, weight, *gates, norm_weight, windows, states, slots)]
    mixed_on, weight_on, decay_rate, dt_bias, norm_weight_on, windows_on, states_on, slots_on = on
    x_on, z_on, b_on, a_on = mixed_on.split([channels, h * dv, h, h], dim=-1)
    q, k, v = conv.to(DEVICE).split([hk * dk, hk * dk, h * dv], dim=-1)
    core = delta_rule_step_at_slots(
        q.view(n, hk, dk),
        k.view(n, hk, dk),
        v.view(n, h, dv),
        a_on,
        b_on,
        expected_states,
        slots_on,
        raw_gates=(decay_rate, dt_bias),
    )
    expected = gated_rmsnorm(core, z_on, norm_weight_on, 1e-6).cpu()
    arrivals = torch.zeros(n * hk, dtype=torch.int32, device=DEVICE)
    out = delta_net_step_at_slots(
        x_on,
        z_on,
        a_on,
        b_on,
        weight_on,
        windows_on,
        states_on,
        slots_on,
        (decay_rate, dt_bias),
        (norm_weight_on, 1e-6),
        hk,
        arrivals,
        tile,
    ).cpu()
    # bf16: the conv's SiLU rounds to the dtype where the reference's may round the other way, and a conv
    # output one ulp off moves the rule's output by more (its q and k are l2-normed, its state remembers)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(out[real], expected[real], **tolerance)
    assert torch.equal(windows_on.cpu(), expected_windows) and not arrivals.any()
    torch.testing.assert_close(states_on.cpu(), expected_states.cpu(), **tolerance)
    assert (states_on.cpu()[[0, 2, 4]] == states[[0, 2, 4]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_at_slots_equals_the_reference(dtype: torch.dtype):
    """Channels over two blocks, rows strided (a view into a wider projection); the padding row's window (the
    sink's) stays zero and untouched slots keep theirs."""
    from executor_svc.kernels.gated_delta_slots import conv_step_at_slots

    channels, width = 1100, 4
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([2, 0, 4])
    wide = torch.randn(3, channels + 7, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    windows = torch.randn(5, channels, width - 1, generator=g).to(dtype)
    windows[0] = 0
    expected_out, moved = ref.conv1d_step(wide[:, :channels], weight, windows[slots])
    expected = windows.clone()
    expected[slots[slots != 0]] = moved[slots != 0]
    windows, slots_on = windows.to(DEVICE), slots.to(DEVICE)
    out = conv_step_at_slots(wide.to(DEVICE)[:, :channels], weight.to(DEVICE), windows, slots_on).cpu()
    real = slots != 0
    torch.testing.assert_close(out[real], expected_out[real])
    assert torch.equal(windows.cpu(), expected)


@pytest.mark.parametrize("width", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conv_step_at_slots_at_other_widths(width: int, dtype: torch.dtype):
    """Windows of 1, 2 and 4 entries (padded to a power of two in the kernel), three blocks of channels, two
    padding rows: the same outputs and windows as the reference."""
    from executor_svc.kernels.gated_delta_slots import conv_step_at_slots

    channels = 1100  # blocks of 512, 512 and 76
    g = torch.Generator().manual_seed(width)
    slots = torch.tensor([2, 0, 4, 0, 1])
    wide = torch.randn(len(slots), channels + 7, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    windows = torch.randn(6, channels, width - 1, generator=g).to(dtype)
    windows[0] = 0
    expected_out, moved = ref.conv1d_step(wide[:, :channels], weight, windows[slots])
    real = slots != 0
    expected = windows.clone()
    expected[slots[real]] = moved[real]
    on_device = windows.to(DEVICE)
    out = conv_step_at_slots(wide.to(DEVICE)[:, :channels], weight.to(DEVICE), on_device, slots.to(DEVICE))
    torch.testing.assert_close(out.cpu()[real], expected_out[real])
    assert torch.equal(on_device.cpu(), expected)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("fla")), reason="fla-core on a CUDA device"
)
def test_fla_prefill_equals_the_reference_by_sequence():
    """The CUDA prefill (one packed conv and one varlen fla call for the batch's sequences) leaves the pools and
    gives the output of the reference's sequence by sequence prefill, in bf16 within its rounding; fresh
    sequences start from zeros whatever their slot held."""
    from executor_svc.kernels import gated_delta_fla

    hk, dk, h, dv, width = 2, 64, 4, 64, 4
    channels = 2 * hk * dk + h * dv
    starts = np.array([0, 70, 71, 200, 260])
    tokens = int(starts[-1])
    g = torch.Generator().manual_seed(7)
    mixed = torch.randn(tokens, channels, generator=g).bfloat16().cuda()
    weight = (torch.randn(channels, width, generator=g) * 0.5).bfloat16().cuda()
    decay = (-torch.rand(tokens, h, generator=g) * 0.5).cuda()
    beta = torch.rand(tokens, h, generator=g).bfloat16().cuda()
    conv = torch.randn(6, channels, width - 1, generator=g).bfloat16().cuda()
    recurrent = (torch.randn(6, h, dv, dk, generator=g) * 0.1).cuda()  # value-major, as the pool's
    host_slots, fresh = np.array([4, 1, 5, 2]), np.array([False, True, False, True])
    states = StateInputs(None, torch.from_numpy(host_slots).cuda(), starts, host_slots, fresh)  # type: ignore[arg-type]

    def split(x: torch.Tensor):
        q, k, v = x.split([hk * dk, hk * dk, h * dv], dim=-1)
        return q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, h, dv)

    pools = [(conv.clone(), recurrent.clone()) for _ in range(2)]
    prefill = gated_delta_fla.prefill_for(torch.device("cuda"), torch.bfloat16)
    out = prefill(mixed, weight, decay, beta, *pools[0], states, split)
    assert not prefill.failed, "fla's kernel failed and fell back"
    expected = ref.prefill_at_slots(mixed, weight, decay, beta, *pools[1], states, split)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pools[0][0].float(), pools[1][0].float())
    torch.testing.assert_close(pools[0][1], pools[1][1], atol=3e-2, rtol=3e-2)
