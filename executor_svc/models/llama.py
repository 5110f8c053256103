"""Llama-family decoder (SmolLM2 and kin) whose attention reads and writes a paged KV pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.kv_pool import KVPool

if TYPE_CHECKING:
    from executor_svc.attention import Attention, StepInputs


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    max_seq_len: int
    tie_embeddings: bool
    eos_token_id: int
    bos_token_id: int | None
    name: str

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_seq_len": self.max_seq_len,
        }
        for key, value in sizes.items():
            if value < 1:
                raise ValueError(f"{key} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError(
                f"rope_theta and rms_eps must be positive, got {self.rope_theta}, {self.rms_eps}"
            )
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"eos_token_id {self.eos_token_id} is outside the vocabulary ({self.vocab_size})"
            )


def _weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every weight, so random init would be wasted time.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(vocab_size, hidden_size, device=device, dtype=dtype)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _weight(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as Hugging Face does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj = _Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, device, dtype)
        self.k_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, device, dtype)
        self.v_proj = _Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, device, dtype)
        self.o_proj = _Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, device, dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, device, dtype)
        self.up_proj = _Linear(cfg.hidden_size, cfg.intermediate_size, device, dtype)
        self.down_proj = _Linear(cfg.intermediate_size, cfg.hidden_size, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)
        self.self_attn = _Attention(cfg, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)
        self.mlp = _MLP(cfg, device, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's Llama with the leading `model.` dropped.

    One entry point, `forward(inputs, attention)`: a position for each of B rows, whether the rows are a
    decode step's or a packed prefill batch's tokens, eager or captured. The attention backend reads the
    pages and says which ops the rest of the layer runs in (Triton kernels or torch ops).
    """

    rope_cos: torch.Tensor  # buffers [max_seq_len, head_dim], registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, self.device, dtype)
        self.layers = nn.ModuleList(_Layer(config, self.device, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, self.device, dtype)
        self.lm_head = (
            None
            if config.tie_embeddings
            else _Linear(config.hidden_size, config.vocab_size, self.device, dtype)
        )
        self.scale = config.head_dim**-0.5
        # Same arithmetic as Hugging Face's default rope, on the same device, so the tables match it bit for bit.
        steps = torch.arange(0, config.head_dim, 2, dtype=torch.float, device=self.device)
        inv_freq = 1.0 / (config.rope_theta ** (steps / config.head_dim))
        positions = torch.arange(config.max_seq_len, dtype=torch.float, device=self.device)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # angles: [max_seq_len, head_dim]
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)
        self._fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # see _fused_projections

    def make_kv_pool(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVPool:
        cfg = self.config
        return KVPool(
            cfg.num_layers,
            num_pages,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            device=self.device if device is None else device,
        )

    def _decoder_layers(self) -> Sequence[_Layer]:
        """self.layers, each a _Layer (nn.ModuleList types its items as Module)."""
        return cast("Sequence[_Layer]", self.layers)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def _project_qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x[n, hidden] -> q[n, H, D], k[n, KVH, D], v[n, KVH, D], with rope applied to q and k."""
        cfg = self.config
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        q = attn.q_proj(h).view(-1, cfg.num_heads, cfg.head_dim)
        k = attn.k_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(attn_out.flatten(1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One position for each of B rows, writing its K/V to (inputs.write_page, inputs.write_offset) of
        attention.kv; `select` the rows that need logits (default all). Returns float32 logits[B or
        len(select), V]. Fixed shapes; no host reads (but the CPU attention's trim to the longest row)."""
        if attention.fused:
            return self._forward_kernels(inputs, attention, select)
        return self._forward_torch(inputs, attention, select)

    def _forward_torch(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None
    ) -> torch.Tensor:
        """The layers in torch ops (the CPU path and the reference)."""
        kv = attention.kv
        cos, sin = self.rope_cos[inputs.positions], self.rope_sin[inputs.positions]
        x = self.embed_tokens(inputs.tokens)  # x: [B, hidden]
        for index, layer in enumerate(self._decoder_layers()):
            q, k, v = self._project_qkv(layer, x, cos, sin)
            kv.write(index, inputs.write_page, inputs.write_offset, k, v)
            x = self._finish_layer(layer, x, attention.forward(index, q))
        return self._logits(x if select is None else x.index_select(0, select))

    def _fused_projections(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (qkv [(H + 2 KVH) * D, hidden], gate_up [2 I, hidden]): one matmul where the eager
        step makes three, and two. Built once, on first use (after loading); the separate projection
        weights become views into them, so both paths read the same memory and a later in-place load
        reaches both."""
        if self._fused is None:
            # Normal tensors even when first called under inference mode, so a later in-place load works.
            with torch.inference_mode(False):
                self._fused = [self._fuse_layer(layer) for layer in self._decoder_layers()]
        return self._fused

    @staticmethod
    def _fuse_layer(layer: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = layer.self_attn, layer.mlp
        joined = []
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            weights = torch.cat([p.weight.detach() for p in group])
            start = 0
            for p in group:
                rows = p.weight.shape[0]
                p.weight.data = weights[start : start + rows]
                start += rows
            joined.append(weights)
        return joined[0], joined[1]

    def _forward_kernels(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None
    ) -> torch.Tensor:
        """The layers in the Triton kernels: fused projections, rope with the K/V write, norms with the
        residual."""
        from executor_svc.kernels import gemv
        from executor_svc.kernels.fused import rmsnorm_residual, rope_kv_write, silu_mul

        cfg, kv = self.config, attention.kv
        heads, kv_heads, head_dim, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
        q_end = heads * head_dim
        k_end = q_end + kv_heads * head_dim
        x = self.embed_tokens(inputs.tokens)  # x: [B, hidden]
        batch = x.shape[0]
        # A few rows: each projection one GEMV kernel that also norms its input (and gates gate_up's output);
        # more: cuBLAS GEMMs between the norm and SiLU kernels.
        few = batch <= gemv.MAX_ROWS

        def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return gemv.gemv(x, weight)[0] if few else F.linear(x, weight)

        def norm_project(x, residual, norm_weight, weight, gated=False) -> tuple[torch.Tensor, torch.Tensor]:
            if few:
                return gemv.gemv(x, weight, norm=(residual, norm_weight, eps), gated=gated)
            h, residual = rmsnorm_residual(x, residual, norm_weight, eps)
            out = F.linear(h, weight)
            return (silu_mul(out) if gated else out), residual

        residual = None  # the first norm's "sum" is the embedding itself
        fused = self._fused_projections()
        for index, (layer, (qkv_weight, gate_up_weight)) in enumerate(
            zip(self._decoder_layers(), fused, strict=True)
        ):
            # qkv: [B, (H + 2 KVH) * D]
            qkv, residual = norm_project(x, residual, layer.input_layernorm.weight, qkv_weight)
            q = qkv[:, :q_end].view(batch, heads, head_dim)
            k = qkv[:, q_end:k_end].view(batch, kv_heads, head_dim)
            v = qkv[:, k_end:].view(batch, kv_heads, head_dim)
            q = rope_kv_write(
                q,
                k,
                v,
                inputs.positions,
                self.rope_cos,
                self.rope_sin,
                kv.k[index],
                kv.v[index],
                inputs.write_page,
                inputs.write_offset,
            )
            x = project(attention.forward(index, q).flatten(1), layer.self_attn.o_proj.weight)
            # act: [B, I], SiLU(gate) * up
            act, residual = norm_project(
                x, residual, layer.post_attention_layernorm.weight, gate_up_weight, True
            )
            x = project(act, layer.mlp.down_proj.weight)
        if select is not None:
            assert residual is not None, "no layer ran: the model has num_layers >= 1"
            x, residual = x.index_select(0, select), residual.index_select(0, select)
        h, _ = rmsnorm_residual(x, residual, self.norm.weight, eps)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float()
