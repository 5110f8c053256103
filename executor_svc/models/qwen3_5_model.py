"""The Qwen3.5 hybrid decoder: gated delta net layers whose conv window and recurrent state live in a state
pool by slot, and gated full-attention layers (output gate, partial rotary, q/k norms) over the paged KV
pool; (1 + w) RMSNorms; the layer pattern from `layer_types`. transformers' modeling_qwen3_5 is the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.kernels import gated_delta_ref as ref
from executor_svc.kernels.gated_delta_fla import capturable, prefill_for
from executor_svc.models.qwen3_5_config import FULL, LINEAR, Qwen35Config
from executor_svc.models.rope import default_inv_freq, rope_tables
from executor_svc.models.staged import StagedModel
from executor_svc.stage import Stage
from executor_svc.state_pool import StateInputs, StatePool

if TYPE_CHECKING:
    from executor_svc.attention import Attention, StepInputs
    from executor_svc.models.qwen3_5_kernels import FusedWeights


def _weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every weight.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(n_out, n_in, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Embedding(_Linear):
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + w) in float32, then cast (Qwen3.5's, unlike Llama's w * x.to(dtype))."""

    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """w * norm(x), then times SiLU(gate): the gated delta net's output norm."""

    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class _GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.head_dim
        # q_proj's rows per head: the query's D, then its output gate's D
        self.q_proj = _Linear(cfg.hidden_size, cfg.num_heads * d * 2, device, dtype)
        self.k_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * d, device, dtype)
        self.v_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * d, device, dtype)
        self.o_proj = _Linear(cfg.num_heads * d, cfg.hidden_size, device, dtype)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_eps, device, dtype)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_eps, device, dtype)


class _Conv1d(nn.Module):
    def __init__(self, channels: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(channels, 1, width, device=device, dtype=dtype)  # depthwise, as nn.Conv1d's


class _GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        heads, value_size = cfg.linear_value_heads, cfg.linear_value_heads * cfg.linear_value_dim
        self.in_proj_qkv = _Linear(cfg.hidden_size, cfg.conv_channels, device, dtype)
        self.in_proj_z = _Linear(cfg.hidden_size, value_size, device, dtype)
        self.in_proj_b = _Linear(cfg.hidden_size, heads, device, dtype)
        self.in_proj_a = _Linear(cfg.hidden_size, heads, device, dtype)
        self.conv1d = _Conv1d(cfg.conv_channels, cfg.conv_width, device, dtype)
        self.dt_bias = _weight(heads, device=device, dtype=dtype)
        self.A_log = _weight(heads, device=device, dtype=dtype)
        self.norm = GatedRMSNorm(cfg.linear_value_dim, cfg.rms_eps, device, dtype)
        self.out_proj = _Linear(value_size, cfg.hidden_size, device, dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: Qwen35Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, device, dtype)
        self.up_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, device, dtype)
        self.down_proj = _Linear(cfg.intermediate_size, cfg.hidden_size, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = _GatedDeltaNet(cfg, device, dtype)
        else:
            self.self_attn = _GatedAttention(cfg, device, dtype)
        self.mlp = _MLP(cfg, device, dtype)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x[B, heads, D] with rope on its first rotary_dim dims (cos, sin [B, 1, rotary_dim]), the rest as it is."""
    rot = cos.shape[-1]
    return torch.cat((x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin, x[..., rot:]), dim=-1)


def _decode_rule_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The gated delta rule's decode step on the pool's states by slot: the Triton kernel on CUDA, the torch
    reference (a gather and a scatter) on the CPU."""
    if device.type == "cuda":
        from executor_svc.kernels.gated_delta_slots import delta_rule_step_at_slots

        return delta_rule_step_at_slots
    return ref.delta_rule_step_at_slots


class Qwen35Model(StagedModel[Qwen35Config]):
    """Parameter names follow transformers' Qwen3_5ForCausalLM with the leading `model.` dropped.

    The KV pool holds the stage's full-attention layers only (KV layer i is the i-th of them); the state pool
    its gated delta net layers (state layer j is the j-th of them); a whole model is the stage of every layer.
    One entry point, `forward(inputs, attention)`, as Llama's: the rows are a decode step's (one token a
    sequence, `inputs.states.seq_starts` None) or a packed prefill batch's tokens; `inputs.states` says which
    state slot each sequence reads and writes.
    """

    rope_cos: torch.Tensor  # buffers [max_seq_len, rotary_dim], registered in __init__
    rope_sin: torch.Tensor
    embed_tokens: _Embedding | None

    def __init__(
        self, config: Qwen35Config, device: torch.device | str, dtype: torch.dtype, stage: Stage | None = None
    ) -> None:
        super().__init__(config, device, dtype, stage)
        held = self.stage.layers
        self.layer_types = config.layer_types[held.begin : held.end]  # this stage's
        self.embed_tokens = (
            _Embedding(config.hidden_size, config.vocab_size, self.device, dtype)
            if held.holds_embedding(config.tie_embeddings)
            else None
        )
        self.layers = nn.ModuleList(_Layer(config, kind, self.device, dtype) for kind in self.layer_types)
        self.norm = (
            OffsetRMSNorm(config.hidden_size, config.rms_eps, self.device, dtype) if held.last else None
        )
        self.lm_head = (
            _Linear(config.hidden_size, config.vocab_size, self.device, dtype)
            if held.holds_head(config.tie_embeddings)
            else None
        )
        # The decode step reads and updates the states in the pool by slot (Triton on CUDA); prefill in
        # fla-core's chunked kernel, the batch's sequences in one call, for 16-bit models on CUDA; the torch
        # reference otherwise.
        self._decode_rule = _decode_rule_for(self.device)
        self._prefill = prefill_for(self.device, dtype)
        # The layer's index in this stage's pool: KV layers for full attention, state layers for gated delta nets.
        self.pool_index = [self.layer_types[:i].count(kind) for i, kind in enumerate(self.layer_types)]
        self.fused: FusedWeights | None = None  # built by qwen3_5_kernels on the first fused forward
        # Default rope over the first rotary_dim dims only (partial rotary), as transformers computes it.
        inv_freq = default_inv_freq(config.rope_theta, config.rotary_dim)
        cos, sin = rope_tables(inv_freq, 1.0, config.max_seq_len, self.device, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def prefill_capturable(self) -> bool:
        """Whether a prefill step can be captured in a CUDA graph: its gated delta nets in fla's kernels."""
        return capturable(self._prefill)

    @property
    def recurrent_layers(self) -> int:
        """This stage's gated delta net layers (none in a stage of full-attention layers only)."""
        return self.layer_types.count(LINEAR)

    @property
    def kv_layers(self) -> int:
        return self.layer_types.count(FULL)  # none in a stage of gated delta nets only

    def make_state_pool(self, num_slots: int, device: torch.device | str | None = None) -> StatePool:
        cfg = self.config
        return StatePool(
            self.recurrent_layers,
            num_slots,
            cfg.conv_channels,
            cfg.conv_width,
            cfg.linear_value_heads,
            cfg.linear_key_dim,
            cfg.linear_value_dim,
            dtype=self.dtype,
            device=self.device if device is None else device,
        )

    def _decoder_layers(self) -> Sequence[_Layer]:
        return self.layers  # type: ignore[return-value]

    @property
    def head(self) -> tuple[OffsetRMSNorm, torch.Tensor]:
        """The last stage's final norm and head weight [V, hidden] (the embedding's where they are tied)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        assert self.norm is not None and head is not None, "only the last stage holds the norm and head"
        return self.norm, head.weight

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Logits[B or len(select), V] (ExecutorModel.forward's) of the rows on the last stage (an earlier stage
        hands its hidden states on and returns None); writes each full-attention layer's K/V at (inputs.write_page,
        inputs.write_offset) and each recurrent layer's state at its slots."""
        states = inputs.states
        if states is None:
            raise ValueError("a Qwen3.5 step needs its state slots (inputs.states)")
        # On CUDA, a decode step or a prefill batch: the Triton kernels (whose attention parts take power-of-two
        # heads, as published)
        if attention.fused and not self.config.head_dim & (self.config.head_dim - 1):
            from executor_svc.models.qwen3_5_kernels import forward_kernels

            return forward_kernels(self, inputs, attention, select)
        cos = self.rope_cos[inputs.positions][:, None, :]  # cos, sin: [B, 1, rotary_dim]
        sin = self.rope_sin[inputs.positions][:, None, :]
        x = self.enter(inputs.tokens)  # x: [B, hidden]
        for layer, pool_index in zip(self._decoder_layers(), self.pool_index, strict=True):
            h = layer.input_layernorm(x)
            if layer.kind == LINEAR:
                x = x + self._delta_net(layer.linear_attn, h, states, pool_index)
            else:
                x = x + self._attention(layer.self_attn, h, inputs, attention, pool_index, cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not self.stage.layers.last:
            self.stage.hand_on(x)
            return None
        if select is not None:
            x = x.index_select(0, select)
        norm, head = self.head
        return F.linear(norm(x), head)

    def _attention(
        self,
        attn: _GatedAttention,
        h: torch.Tensor,
        inputs: StepInputs,
        attention: Attention,
        kv_layer: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        d = cfg.head_dim
        query_gate = attn.q_proj(h).view(-1, cfg.num_heads, 2 * d)
        q, gate = query_gate[..., :d], query_gate[..., d:].reshape(h.shape[0], -1)  # q: [B, H, D]
        q = attn.q_norm(q)
        k = attn.k_norm(attn.k_proj(h).view(-1, cfg.num_kv_heads, d))
        v = attn.v_proj(h).view(-1, cfg.num_kv_heads, d)
        q, k = rope_partial(q, cos, sin), rope_partial(k, cos, sin)
        attention.kv.write(kv_layer, inputs.write_page, inputs.write_offset, k, v)
        out = attention.forward(kv_layer, q.contiguous()).flatten(1)
        return attn.o_proj(out * torch.sigmoid(gate))

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed [T, C] (after the conv) -> q, k [T, Hk, Dk], v [T, H, Dv], views."""
        cfg = self.config
        hk, dk, hv, dv = (
            cfg.linear_key_heads,
            cfg.linear_key_dim,
            cfg.linear_value_heads,
            cfg.linear_value_dim,
        )
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        return q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, hv, dv)

    def _delta_net(
        self, net: _GatedDeltaNet, h: torch.Tensor, states: StateInputs, state_layer: int
    ) -> torch.Tensor:
        cfg = self.config
        hv, dv = cfg.linear_value_heads, cfg.linear_value_dim
        mixed = net.in_proj_qkv(h)  # mixed: [T, C], q | k | v before the conv
        z = net.in_proj_z(h).view(-1, hv, dv)
        beta = torch.sigmoid(net.in_proj_b(h))  # beta, g: [T, H]
        g = -net.A_log.float().exp() * F.softplus(net.in_proj_a(h).float() + net.dt_bias)
        weight = net.conv1d.weight[:, 0, :]  # [C, K]
        conv, recurrent = states.pool.conv[state_layer], states.pool.recurrent[state_layer]
        split = self.split_heads
        if (
            states.seq_starts is None
        ):  # decode: one token of each row's sequence, states read and written by slot
            slots = states.slots
            real = (slots != 0)[:, None, None]  # padding rows write zeros back into the sink slot
            mixed, window = ref.conv1d_step(mixed, weight, conv.index_select(0, slots))
            conv.index_copy_(0, slots, window * real)
            out = self._decode_rule(*split(mixed), g, beta, recurrent, slots)
        else:
            out = self._prefill(mixed, weight, g, beta, conv, recurrent, states, split)
        core = net.norm(out.to(h.dtype), z)  # core: [T, H, Dv]
        return net.out_proj(core.flatten(1))
