"""Llama-family decoder (SmolLM2 and kin) whose attention reads and writes a paged KV pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention.torch_ref import decode_attention, prefill_attention_batch
from executor_svc.kv_pool import KVPool
from protos.layout import RowLayout

if TYPE_CHECKING:
    from executor_svc.kernels.tables import StepInputs
    from executor_svc.prefill_batch import PrefillBatch

# attend(layer, q[B, H, D]) -> [B, H, D]: the decode attention of one layer, whatever backend reads the pages.
Attend = Callable[[int, torch.Tensor], torch.Tensor]


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

    `prefill` runs a step's prompt chunks as one packed batch, eagerly; `decode` runs one token for each of B rows as
    fixed-shape tensor work (no host reads outside the CPU attention trim), ready for graph capture.
    `decode_resident` is the same step in Triton kernels that read each row off the slot store by slot.
    """

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
    def prefill(self, batch: PrefillBatch, kv: KVPool, select: torch.Tensor | None = None) -> torch.Tensor:
        """Run a packed batch of chunks (PrefillBatch.build) in torch ops, attention chunk by chunk with SDPA
        (the CPU path); the K/V of each chunk's earlier positions are in its pages already. Returns float32
        logits of the tokens `select` picks (default each chunk's last: [N, V])."""
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        x = self.embed_tokens(batch.token_ids)  # x: [T, hidden]
        for index, layer in enumerate(self.layers):
            q, k, v = self._project_qkv(layer, x, cos, sin)
            kv.write(index, batch.write_pages, batch.write_offsets, k, v)
            out = prefill_attention_batch(q, kv.k[index], kv.v[index], batch, self.scale)
            x = self._finish_layer(layer, x, out)
        return self._logits(x.index_select(0, batch.last_index if select is None else select))

    def prefill_fused(
        self, batch: PrefillBatch, kv: KVPool, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`prefill` in the Triton kernels of the decode step, with the batch's causal attention in one launch
        per layer for all chunks (the GPU path; fixed shapes, nothing read back: a graph can hold it). Returns
        float32 logits of the tokens `select` picks (default each chunk's last)."""
        from executor_svc.kernels.prefill_attention import paged_prefill_attention
        from executor_svc.kernels.tables import StepInputs

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return paged_prefill_attention(q, kv.k[layer], kv.v[layer], batch, self.scale)

        # A prefill token is a row whose stored length before it is its position.
        inputs = StepInputs(
            batch.token_ids, batch.positions, batch.positions, batch.write_pages, batch.write_offsets
        )
        return self.forward_fused(inputs, kv, attend, select=batch.last_index if select is None else select)

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_lens: torch.Tensor,
        block_tables: torch.Tensor,
        kv: KVPool,
    ) -> torch.Tensor:
        """One new token per row: tokens, positions int64[B]; kv_lens int32[B] (stored before this step);
        block_tables int32[B, W]. Returns float32 logits[B, V].

        The token's K/V goes to page block_tables[b, kv_lens[b] // P], offset kv_lens[b] % P, and the row
        attends over kv_lens[b] + 1 positions. Padding rows: token 0, length 0, block table of zeros
        (the sink page).
        """
        page_size = kv.page_size
        write_pages = block_tables.gather(1, (kv_lens // page_size).long()[:, None])[:, 0]
        write_offsets = kv_lens % page_size
        attn_lens = kv_lens + 1
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed_tokens(tokens)  # x: [B, hidden]
        for index, layer in enumerate(self.layers):
            q, k, v = self._project_qkv(layer, x, cos, sin)
            kv.write(index, write_pages, write_offsets, k, v)
            out = decode_attention(q, kv.k[index], kv.v[index], block_tables, attn_lens, self.scale)
            x = self._finish_layer(layer, x, out)
        return self._logits(x)

    def _fused_projections(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (qkv [(H + 2 KVH) * D, hidden], gate_up [2 I, hidden]): one matmul where the eager
        step makes three, and two. Built once, on first use (after loading); the separate projection
        weights become views into them, so both paths read the same memory and a later in-place load
        reaches both."""
        if self._fused is None:
            # Normal tensors even when first called under inference mode, so a later in-place load works.
            with torch.inference_mode(False):
                self._fused = [self._fuse_layer(layer) for layer in self.layers]
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

    @torch.inference_mode()
    def forward_fused(
        self, inputs: StepInputs, kv: KVPool, attend: Attend, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One position for each of B rows with the Triton kernels, writing its K/V: a decode step's rows
        (inputs from `gather_inputs`, or built on the host) or a packed prefill batch's tokens. `attend` is the
        attention backend; `select` the rows that need logits (default all). Returns float32 logits[B or
        len(select), V]. Fixed shapes, no host reads."""
        from executor_svc.kernels import gemv
        from executor_svc.kernels.fused import rmsnorm_residual, rope_kv_write, silu_mul

        cfg = self.config
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
        for index, (layer, (qkv_weight, gate_up_weight)) in enumerate(zip(self.layers, fused, strict=True)):
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
            x = project(attend(index, q).flatten(1), layer.self_attn.o_proj.weight)
            # act: [B, I], SiLU(gate) * up
            act, residual = norm_project(
                x, residual, layer.post_attention_layernorm.weight, gate_up_weight, True
            )
            x = project(act, layer.mlp.down_proj.weight)
        if select is not None:
            x, residual = x.index_select(0, select), residual.index_select(0, select)
        h, _ = rmsnorm_residual(x, residual, self.norm.weight, eps)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float()

    def decode_resident(
        self,
        rows: torch.Tensor,
        step_slots: torch.Tensor,
        last_token: torch.Tensor,
        kv: KVPool,
        splits: int = 1,
        split_counters: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step that reads everything off the slot store by slot: rows int32[S, C], step_slots [B]
        (0 = padding, which reads the sink row), last_token i64[S] (the loop-back buffer). Attention takes
        `splits` split-K partitions (fixed per captured bucket; `split_counters` as paged_decode_attention's
        counters). Returns float32 logits[B, V] and the rows'
        positions i64[B] (the sampler's counter is position + 1)."""
        from executor_svc.kernels.attention import paged_decode_attention
        from executor_svc.kernels.tables import gather_inputs

        page_size = kv.page_size
        inputs = gather_inputs(rows, step_slots, last_token, page_size)

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return paged_decode_attention(
                q,
                kv.k[layer],
                kv.v[layer],
                rows,
                step_slots,
                RowLayout.BLOCK_TABLE,
                page_size,
                self.scale,
                splits,
                split_counters,
            )

        return self.forward_fused(inputs, kv, attend), inputs.positions
