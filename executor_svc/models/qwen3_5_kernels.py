"""The Qwen3.5 hybrid's forward in the Triton kernels (the CUDA path), of a decode step or a packed prefill
batch: each layer's projections joined into one matmul that also norms its input, the gated delta net's conv
window and rule step on the state pool by slot (prefill: the packed conv kernel and fla's chunked rule, through
the model's prefill), then its gated norm, all three in one kernel for the narrowest decode steps (one row of 16
heads). The torch forward in qwen3_5_model.py is its reference; a decode step there launches some forty kernels
a layer, here six to eight (what bounds the step at small batches); a prefill layer some seventy against about
twenty, each a few microseconds of host work."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from executor_svc.models.dense_kernels import Projections, join_rows, tensor
from executor_svc.models.qwen3_5_config import LINEAR

if TYPE_CHECKING:
    from executor_svc.attention import Attention, StepInputs
    from executor_svc.kernels.skinny_gemm import SplitSums
    from executor_svc.models.qwen3_5_model import Qwen35Model, _Layer
    from executor_svc.state_pool import StateInputs


class FusedLayer(NamedTuple):
    """One layer's projections joined, and its (1 + w) norm weights in float32 (what the fused norms scale by)."""

    in_weight: (
        torch.Tensor
    )  # gated delta net: [C + H Dv + 2 H, hidden], qkv | z | b | a; attention: q+gate | k | v
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    input_norm: torch.Tensor  # f32[hidden]
    post_norm: torch.Tensor  # f32[hidden]
    head_norms: tuple[torch.Tensor, torch.Tensor] | None  # attention: f32[D] each, q's and k's
    gates: tuple[torch.Tensor, torch.Tensor] | None  # gated delta net: f32[H] each, -exp(A_log) and dt_bias


class FusedWeights(NamedTuple):
    layers: list[FusedLayer]
    final_norm: torch.Tensor | None  # f32[hidden], 1 + w; None before a split's last stage


def _offset(norm_weight: torch.Tensor) -> torch.Tensor:
    return 1.0 + norm_weight.detach().float()


def fused_weights(model: Qwen35Model) -> FusedWeights:
    """The model's layers fused, built once on first use (after loading). The joined projections are the
    weights' memory (the separate weights become views into them); the float32 norm and gate vectors are copies
    made from the loaded weights."""
    if model.fused is None:
        with torch.inference_mode(False):  # normal tensors, so the views stay loadable in place
            layers = [_fuse_layer(layer) for layer in model._decoder_layers()]
            final_norm = None if model.norm is None else _offset(model.norm.weight)
            model.fused = FusedWeights(layers, final_norm)
    return model.fused


def _fuse_layer(layer: _Layer) -> FusedLayer:
    mlp = layer.mlp
    gate_up = join_rows([mlp.gate_proj.weight, mlp.up_proj.weight])
    norms = _offset(layer.input_layernorm.weight), _offset(layer.post_attention_layernorm.weight)
    if layer.kind == LINEAR:
        net = layer.linear_attn
        projections = (net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a)
        gates = -net.A_log.detach().float().exp(), net.dt_bias.detach().float()
        return FusedLayer(join_rows([p.weight for p in projections]), gate_up, *norms, None, gates)
    attn = layer.self_attn
    in_weight = join_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    return FusedLayer(
        in_weight, gate_up, *norms, (_offset(attn.q_norm.weight), _offset(attn.k_norm.weight)), None
    )


def forward_kernels(
    model: Qwen35Model, inputs: StepInputs, attention: Attention, select: torch.Tensor | None
) -> torch.Tensor | None:
    """Qwen35Model.forward of a decode step or a prefill batch in the Triton kernels: logits[B or
    len(select), V] (None before the last stage of a split)."""
    from executor_svc.kernels.fused import rmsnorm_residual
    from executor_svc.kernels.gated_delta_joined import joined_step_wins

    cfg, states = model.config, inputs.states
    assert states is not None, "a Qwen3.5 step carries its state slots"
    eps = cfg.rms_eps
    embedded = model.enter(inputs.tokens)  # embedded: [B, hidden] (prefill: B tokens)
    projections = Projections(embedded.shape[0], eps)
    project_to_norm, norm_project = projections.project_to_norm, projections.norm_project

    weights = fused_weights(model)
    # the narrowest decode steps' arrival counters for the gated delta nets' one-kernel step, one a row and key
    # head, which each layer's kernel leaves zero for the next: one memset a step
    arrivals = None
    if states.seq_starts is None and joined_step_wins(embedded.shape[0], cfg.linear_value_heads):
        arrivals = torch.zeros(
            embedded.shape[0] * cfg.linear_key_heads, dtype=torch.int32, device=embedded.device
        )
    residual = None  # the first norm's "sum" is the embedding itself
    x: torch.Tensor | SplitSums = embedded  # a layer's output, for the next layer's norm
    for layer, fused, pool_index in zip(
        model._decoder_layers(), weights.layers, model.pool_index, strict=True
    ):
        mixed, residual = norm_project(x, residual, fused.input_norm, fused.in_weight)
        if layer.kind == LINEAR:
            core = _delta_net_core(model, layer, fused, mixed, states, pool_index, arrivals)
            x = project_to_norm(core, layer.linear_attn.out_proj.weight)
        else:
            gated = _attention_core(model, fused, mixed, inputs, attention, pool_index)
            x = project_to_norm(gated, layer.self_attn.o_proj.weight)
        act, residual = norm_project(x, residual, fused.post_norm, fused.gate_up_weight, gated=True)
        x = project_to_norm(act, layer.mlp.down_proj.weight)
    assert residual is not None, "no layer ran: a stage holds at least one layer"
    if not model.stage.layers.last:  # the next stage starts from the sum, as a first stage from its embedding
        model.stage.hand_on(tensor(x) + residual)
        return None
    if select is not None:
        x, residual = tensor(x).index_select(0, select), residual.index_select(0, select)
    assert weights.final_norm is not None, "the last stage holds the final norm"
    h, _ = rmsnorm_residual(x, residual, weights.final_norm, eps)
    return F.linear(h, model.head[1])


def _delta_net_core(
    model: Qwen35Model,
    layer: _Layer,
    fused: FusedLayer,
    mixed: torch.Tensor,
    states: StateInputs,
    state_layer: int,
    arrivals: torch.Tensor | None,
) -> torch.Tensor:
    """mixed [B, C + H Dv + 2 H] (the joined projection) -> the normed, gated core [B, H Dv], the pool's conv
    window and recurrent state moved on at each row's slot (prefill: at each sequence's). arrivals: a decode
    step's counters (delta_net_step_at_slots')."""
    from executor_svc.kernels.fused import gated_rmsnorm
    from executor_svc.kernels.gated_delta_joined import delta_net_step_at_slots, joined_step_wins
    from executor_svc.kernels.gated_delta_slots import conv_step_at_slots, delta_rule_step_at_slots

    cfg, net = model.config, layer.linear_attn
    hk, dk, hv, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_heads, cfg.linear_value_dim
    channels, values = cfg.conv_channels, hv * dv
    batch = mixed.shape[0]
    z = mixed[:, channels : channels + values]
    b = mixed[:, channels + values : channels + values + hv]
    a = mixed[:, channels + values + hv :]
    pool = states.pool
    assert fused.gates is not None
    conv_weight, conv_state, recurrent = (
        net.conv1d.weight[:, 0, :],
        pool.conv[state_layer],
        pool.recurrent[state_layer],
    )
    if states.seq_starts is not None:  # prefill: g and beta as the torch forward makes them, then its prefill
        decay_rate, dt_bias = fused.gates
        g = decay_rate * F.softplus(a.float() + dt_bias)  # g, beta: [T, H]
        core = model._prefill(
            mixed[:, :channels],
            conv_weight,
            g,
            torch.sigmoid(b),
            conv_state,
            recurrent,
            states,
            model.split_heads,
        )
        return gated_rmsnorm(core, z, net.norm.weight, cfg.rms_eps)
    if joined_step_wins(batch, hv):  # the narrowest steps: one launch
        return delta_net_step_at_slots(
            mixed[:, :channels],
            z,
            a,
            b,
            conv_weight,
            conv_state,
            recurrent,
            states.slots,
            fused.gates,
            (net.norm.weight, cfg.rms_eps),
            hk,
            arrivals,
        )
    # conv: [B, C], q | k | v after the conv and SiLU
    conv = conv_step_at_slots(mixed[:, :channels], conv_weight, conv_state, states.slots)
    q, k, v = conv.split([hk * dk, hk * dk, values], dim=-1)
    out = delta_rule_step_at_slots(
        q.view(batch, hk, dk),
        k.view(batch, hk, dk),
        v.view(batch, hv, dv),
        a,
        b,
        recurrent,
        states.slots,
        raw_gates=fused.gates,
    )
    return gated_rmsnorm(out, z, net.norm.weight, cfg.rms_eps)


def _attention_core(
    model: Qwen35Model,
    fused: FusedLayer,
    mixed: torch.Tensor,
    inputs: StepInputs,
    attention: Attention,
    kv_layer: int,
) -> torch.Tensor:
    """mixed [B, 2 H D + 2 KVH D] (query and its gate per head, k, v) -> the gated attention output [B, H D],
    this step's K/V written to the pool."""
    from executor_svc.kernels.gated_attention import norm_rope_kv_write, output_gate

    cfg, kv = model.config, attention.kv
    assert fused.head_norms is not None
    q = norm_rope_kv_write(
        mixed,
        *fused.head_norms,
        cfg.rms_eps,
        model.rope_cos,
        model.rope_sin,
        inputs.positions,
        kv.k[kv_layer],
        kv.v[kv_layer],
        inputs.write_page,
        inputs.write_offset,
        cfg.num_heads,
    )
    return output_gate(attention.forward(kv_layer, q), mixed)
