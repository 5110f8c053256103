"""The dense decoder (Llama, SmolLM2, Qwen3): every layer attention then a gated MLP, its attention reading and
writing a paged KV pool. What the families differ in is configuration: biases, q/k norms, rope frequencies."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from executor_svc.attention.prefill import PrefillAttention
from executor_svc.attention.torch_ref import TorchDecode
from executor_svc.kv_pool import KVPool
from executor_svc.models.dense_cpu import CpuDecodeLayers
from executor_svc.models.family import check_activation, stop_ids
from executor_svc.models.layers import Embedding, GatedMLP, Linear, RMSNorm, apply_rope
from executor_svc.models.packed_kernel import MAX_ROWS
from executor_svc.models.rope import default_inv_freq, hf_rope, rope_tables
from executor_svc.models.staged import StagedModel
from executor_svc.stage import Stage

# A CPU prefill of up to this many tokens runs in the C decode step, MAX_ROWS tokens a call (each call reads the
# weights once). bench/cpu_prefill.py, SmolLM2 Q4_1, two threads, C step / torch layers ms: 28 tokens 63-83 /
# 127-148, 64 tokens 129-175 / 199-393, 128 tokens 300-409 / 322-350: about the crossover, torch's GEMM ahead above.
CPU_PREFILL_TOKENS = 128

if TYPE_CHECKING:
    from executor_svc.attention import Attention, StepInputs
    from executor_svc.models.dense_kernels import FusedLayer


@dataclass(slots=True)
class DenseConfig:
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
    eos_token_ids: tuple[int, ...]  # every one ends a request (some checkpoints name several)
    bos_token_id: int | None
    name: str
    rope_type: str = "default"  # as transformers names it
    rope_inv_freq: tuple[float, ...] | None = None  # [head_dim / 2] float32 values; None: the default ones
    rope_attention_factor: float = 1.0  # scales cos and sin (yarn)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head, before rope
    attention_bias: bool = False  # q, k, v and o projections
    mlp_bias: bool = False

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
        if not self.eos_token_ids or not all(0 <= eos < self.vocab_size for eos in self.eos_token_ids):
            raise ValueError(
                f"eos_token_ids {list(self.eos_token_ids)} must be one or more ids of the vocabulary "
                f"({self.vocab_size})"
            )
        if self.rope_inv_freq is not None and len(self.rope_inv_freq) != self.head_dim // 2:
            raise ValueError(
                f"rope_inv_freq has {len(self.rope_inv_freq)} values, expected head_dim / 2 = {self.head_dim // 2}"
            )


def dense_config_from_hf(hf: dict[str, Any], path: str, config_class: Any, *, qk_norm: bool) -> DenseConfig:
    """A DenseConfig from config.json's contents, read through transformers' own config class (its defaults and
    rope spellings are the reference's); the stop ids are generation_config.json's where it names them, as
    `generate` uses them."""
    check_activation(hf, path)
    hfc = config_class.from_dict(hf)
    head_dim = getattr(hfc, "head_dim", None) or hfc.hidden_size // hfc.num_attention_heads
    try:
        rope_type, theta, inv_freq, attention_factor = hf_rope(hfc, head_dim)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return DenseConfig(
        vocab_size=hfc.vocab_size,
        hidden_size=hfc.hidden_size,
        num_layers=hfc.num_hidden_layers,
        num_heads=hfc.num_attention_heads,
        num_kv_heads=getattr(hfc, "num_key_value_heads", None) or hfc.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hfc.intermediate_size,
        rope_theta=theta,
        rms_eps=float(hfc.rms_norm_eps),
        max_seq_len=hfc.max_position_embeddings,
        tie_embeddings=bool(hfc.tie_word_embeddings),
        eos_token_ids=stop_ids(hf, path),
        bos_token_id=hfc.bos_token_id,
        name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(path)),
        rope_type=rope_type,
        rope_inv_freq=inv_freq,
        rope_attention_factor=attention_factor,
        qk_norm=qk_norm,
        attention_bias=bool(getattr(hfc, "attention_bias", False)),
        mlp_bias=bool(getattr(hfc, "mlp_bias", False)),
    )


class DenseAttention(nn.Module):
    def __init__(self, cfg: DenseConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        q_size, kv_size, bias = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.attention_bias,
        )
        self.q_proj = Linear(cfg.hidden_size, q_size, device, dtype, bias)
        self.k_proj = Linear(cfg.hidden_size, kv_size, device, dtype, bias)
        self.v_proj = Linear(cfg.hidden_size, kv_size, device, dtype, bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, device, dtype, bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, device, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, device, dtype) if cfg.qk_norm else None
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul (packed.fuse_projections)


class DenseLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)
        self.self_attn = DenseAttention(cfg, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, device, dtype, cfg.mlp_bias)


class DenseModel(StagedModel[DenseConfig]):
    """Parameter names follow Hugging Face's Llama and Qwen3 with the leading `model.` dropped.

    One entry point, `forward(inputs, attention)`: a position for each of B rows, whether the rows are a
    decode step's or a packed prefill batch's tokens, eager or captured. The attention backend reads the
    pages and says which ops the rest of the layer runs in (Triton kernels or torch ops).
    """

    rope_cos: torch.Tensor  # buffers [max_seq_len, head_dim], registered in __init__
    rope_sin: torch.Tensor
    embed_tokens: Embedding | None

    def __init__(
        self, config: DenseConfig, device: torch.device | str, dtype: torch.dtype, stage: Stage | None = None
    ) -> None:
        super().__init__(config, device, dtype, stage)
        held = self.stage.layers
        self.embed_tokens = (
            Embedding(config.vocab_size, config.hidden_size, self.device, dtype)
            if held.holds_embedding(config.tie_embeddings)
            else None
        )
        self.layers = nn.ModuleList(DenseLayer(config, self.device, dtype) for _ in range(held.count))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, self.device, dtype) if held.last else None
        self.lm_head = (
            Linear(config.hidden_size, config.vocab_size, self.device, dtype)
            if held.holds_head(config.tie_embeddings)
            else None
        )
        if config.rope_inv_freq is None:
            inv_freq = default_inv_freq(config.rope_theta, config.head_dim)
        else:
            inv_freq = torch.tensor(config.rope_inv_freq, dtype=torch.float)
        cos, sin = rope_tables(inv_freq, config.rope_attention_factor, config.max_seq_len, self.device, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused_layers: list[FusedLayer] | None = None  # built by dense_kernels on the first fused forward
        # The CPU decode step in C over one pool (None: it cannot serve them), made on the first decode step.
        self.cpu_layers: tuple[KVPool, CpuDecodeLayers | None] | None = None

    @property
    def kv_layers(self) -> int:
        return self.stage.layers.count  # every layer attends

    def decoder_layers(self) -> Sequence[DenseLayer]:
        """self.layers, each a DenseLayer (nn.ModuleList types its items as Module)."""
        return cast("Sequence[DenseLayer]", self.layers)

    @property
    def head(self) -> tuple[RMSNorm, nn.Module]:
        """The last stage's final norm and head module: the LM head, or the embedding where they are tied
        (its `project`); either may hold packed weights."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        assert self.norm is not None and head is not None, "only the last stage holds the norm and head"
        return self.norm, head

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        norm, head = self.head
        h = norm(x)
        # Through the modules, not a weight: a packed head has no float weight.
        return head.project(h) if self.lm_head is None else head(h)  # type: ignore[operator]

    def _project_qkv(
        self, layer: DenseLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x[n, hidden] -> q[n, H, D], k[n, KVH, D], v[n, KVH, D], with rope applied to q and k."""
        cfg = self.config
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        if attn.qkv_proj is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            kv_size = cfg.num_kv_heads * cfg.head_dim
            q, k, v = attn.qkv_proj(h).split([cfg.num_heads * cfg.head_dim, kv_size, kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_layer(self, layer: DenseLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(attn_out.flatten(1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One position for each of B rows, writing its K/V to (inputs.write_page, inputs.write_offset) of
        attention.kv; `select` the rows that need logits (default all). Returns logits[B or len(select), V]
        in the head's dtype (ExecutorModel.forward's) on the last stage; an earlier stage hands its hidden
        states on and returns None. Fixed shapes; no host reads (but the CPU attention's trim to the longest row)."""
        if attention.fused:
            from executor_svc.models.dense_kernels import forward_kernels

            return forward_kernels(self, inputs, attention, select)
        return self._forward_torch(inputs, attention, select)

    def _cpu_layers(
        self, attention: Attention, rows: int
    ) -> tuple[CpuDecodeLayers, tuple[torch.Tensor, torch.Tensor]] | None:
        """The C decode step and the step's block tables and attended lengths where it serves this step: a CPU
        step whose attention reads the pages in place, of at most MAX_ROWS decode rows or CPU_PREFILL_TOKENS
        prefill tokens, over a model and pool it can serve."""
        if isinstance(attention, TorchDecode):
            limit = MAX_ROWS
        elif isinstance(attention, PrefillAttention):
            limit = CPU_PREFILL_TOKENS
        else:
            return None
        if not 0 < rows <= limit:
            return None
        if self.cpu_layers is None or self.cpu_layers[0] is not attention.kv:
            self.cpu_layers = (attention.kv, CpuDecodeLayers.over(self, attention.kv))
        layers = self.cpu_layers[1]
        paged = None if layers is None else attention.paged
        return None if layers is None or paged is None else (layers, paged)

    def _forward_torch(
        self, inputs: StepInputs, attention: Attention, select: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The layers in torch ops (the CPU path and the reference)."""
        kv = attention.kv
        x = self.enter(inputs.tokens)  # x: [B, hidden]
        cpu_step = self._cpu_layers(attention, x.shape[0])
        if cpu_step is not None:
            layers, (tables, attn_lens) = cpu_step
            x = layers.run(x.contiguous(), inputs, tables, attn_lens)
        else:
            cos, sin = self.rope_cos[inputs.positions], self.rope_sin[inputs.positions]
            for index, layer in enumerate(self.decoder_layers()):
                q, k, v = self._project_qkv(layer, x, cos, sin)
                kv.write(index, inputs.write_page, inputs.write_offset, k, v)
                x = self._finish_layer(layer, x, attention.forward(index, q))
        if not self.stage.layers.last:
            self.stage.hand_on(x)
            return None
        return self._logits(x if select is None else x.index_select(0, select))
