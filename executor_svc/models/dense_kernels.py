"""The dense decoder's layers in the Triton kernels (the CUDA path): fused projections, rope with the K/V
write, norms with the residual. The torch forward in dense.py is its reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from executor_svc.attention import Attention, StepInputs
    from executor_svc.kernels.skinny_gemm import SplitSums
    from executor_svc.models.dense import DenseLayer, DenseModel


class FusedLayer(NamedTuple):
    """One layer's projections joined: one matmul where the eager step makes three (q, k, v), and two."""

    qkv_weight: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) * D] (attention_bias)
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None  # [2 I] (mlp_bias)


def fused_layers(model: DenseModel) -> list[FusedLayer]:
    """The model's layers fused, built once, on first use (after loading); the separate projection weights and
    biases become views into them, so both paths read the same memory and a later in-place load reaches both."""
    if model.fused_layers is None:
        # Normal tensors even when first called under inference mode, so a later in-place load works.
        with torch.inference_mode(False):
            model.fused_layers = [_fuse_layer(layer) for layer in model.decoder_layers()]
    return model.fused_layers


def join_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along dim 0, each then a view into the result."""
    joined = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        rows = t.shape[0]
        t.data = joined[start : start + rows]
        start += rows
    return joined


def _fuse_layer(layer: DenseLayer) -> FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
    qkv_biases = [p.bias for p in qkv if p.bias is not None]
    gate_up_biases = [p.bias for p in gate_up if p.bias is not None]
    return FusedLayer(
        join_rows([p.weight for p in qkv]),
        join_rows(qkv_biases) if qkv_biases else None,
        join_rows([p.weight for p in gate_up]),
        join_rows(gate_up_biases) if gate_up_biases else None,
    )


class Projections:
    """A fused decode step's projections, by its row count: a few rows, each projection one GEMV kernel that
    also norms its input (and gates gate_up's output); more, GEMMs between the norm and SiLU kernels: the
    skinny GEMM kernel where it beats cuBLAS (skinny_gemm.wins), cuBLAS elsewhere. A projection whose output
    only feeds the next norm (project_to_norm) leaves the skinny GEMM's split sums for the norm to add up."""

    def __init__(self, rows: int, eps: float) -> None:
        from executor_svc.kernels import gemv

        self.rows = rows
        self.few = rows <= gemv.MAX_ROWS
        self.eps = eps

    def project(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from executor_svc.kernels import gemv, skinny_gemm

        if self.few:
            out = gemv.gemv(x, weight)[0]
        elif skinny_gemm.wins(self.rows, weight.shape[0], weight.shape[1], weight.dtype):
            out = skinny_gemm.skinny_gemm(x, weight)
        else:
            return F.linear(x, weight, bias)
        return out if bias is None else out + bias

    def project_to_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | SplitSums:
        """project's output for the next norm (norm_project's, or the final one) to read: the skinny GEMM's split
        sums where it takes the projection (and no bias follows); tensor() adds them up for any other reader."""
        from executor_svc.kernels import skinny_gemm

        n_out, k_in = weight.shape
        if not self.few and bias is None and skinny_gemm.wins(self.rows, n_out, k_in, weight.dtype):
            return skinny_gemm.skinny_sums(x, weight)
        return self.project(x, weight, bias)

    def norm_project(
        self,
        x: torch.Tensor | SplitSums,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x + residual) * norm_weight projected (SiLU(gate) * up when gated), and the new residual."""
        from executor_svc.kernels import gemv
        from executor_svc.kernels.fused import rmsnorm_residual, silu_mul

        if self.few:
            x = tensor(x)  # (a few rows' projections are the GEMV's: never split sums)
            if bias is None:
                return gemv.gemv(x, weight, norm=(residual, norm_weight, self.eps), gated=gated)
            # the bias goes in before the gate: the GEMV's own gating cannot take it
            out, residual = gemv.gemv(x, weight, norm=(residual, norm_weight, self.eps))
            out = out + bias
        else:
            h, residual = rmsnorm_residual(x, residual, norm_weight, self.eps)
            out = self.project(h, weight, bias)
        # SiLU-mul stays a kernel of its own past the GEMV: read by the down projection's skinny GEMM instead, its
        # input is no longer pipelined into the dot, and the step ran longer in each of four forms (BENCHMARKS)
        return (silu_mul(out) if gated else out), residual


def tensor(x: torch.Tensor | SplitSums) -> torch.Tensor:
    """x, its split sums added up where it is a skinny GEMM's (as the kernels that read them add them)."""
    return x if isinstance(x, torch.Tensor) else x.total()


def forward_kernels(
    model: DenseModel, inputs: StepInputs, attention: Attention, select: torch.Tensor | None
) -> torch.Tensor | None:
    """DenseModel.forward in the Triton kernels: logits[B or len(select), V] (None before the last
    stage of a split)."""
    from executor_svc.kernels.fused import rmsnorm_residual, rope_kv_write

    cfg, kv = model.config, attention.kv
    heads, kv_heads, head_dim, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
    q_end = heads * head_dim
    k_end = q_end + kv_heads * head_dim
    embedded = model.enter(inputs.tokens)  # embedded: [B, hidden]
    batch = embedded.shape[0]
    projections = Projections(batch, eps)
    project_to_norm, norm_project = projections.project_to_norm, projections.norm_project

    def head_norm(x: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """x[B, heads, D] -> each head RMS-normed (Qwen3's q/k norm), contiguous."""
        return rmsnorm_residual(x.reshape(-1, head_dim), None, norm_weight, eps)[0].view(x.shape)

    residual = None  # the first norm's "sum" is the embedding itself
    x: torch.Tensor | SplitSums = embedded  # a layer's output, for the next layer's norm
    for index, (layer, fused) in enumerate(zip(model.decoder_layers(), fused_layers(model), strict=True)):
        attn = layer.self_attn
        # qkv: [B, (H + 2 KVH) * D]
        qkv, residual = norm_project(
            x, residual, layer.input_layernorm.weight, fused.qkv_weight, fused.qkv_bias
        )
        q = qkv[:, :q_end].view(batch, heads, head_dim)
        k = qkv[:, q_end:k_end].view(batch, kv_heads, head_dim)
        v = qkv[:, k_end:].view(batch, kv_heads, head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = head_norm(q, attn.q_norm.weight), head_norm(k, attn.k_norm.weight)
        q = rope_kv_write(
            q,
            k,
            v,
            inputs.positions,
            model.rope_cos,
            model.rope_sin,
            kv.k[index],
            kv.v[index],
            inputs.write_page,
            inputs.write_offset,
        )
        attended = attention.forward(index, q).flatten(1)
        x = project_to_norm(attended, attn.o_proj.weight, attn.o_proj.bias)
        # act: [B, I], SiLU(gate) * up
        act, residual = norm_project(
            x, residual, layer.post_attention_layernorm.weight, fused.gate_up_weight, fused.gate_up_bias, True
        )
        x = project_to_norm(act, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
    assert residual is not None, "no layer ran: a stage holds at least one layer"
    if not model.stage.layers.last:  # the next stage starts from the sum, as a first stage from its embedding
        model.stage.hand_on(tensor(x) + residual)
        return None
    if select is not None:
        x, residual = tensor(x).index_select(0, select), residual.index_select(0, select)
    norm, head = model.head
    h, _ = rmsnorm_residual(x, residual, norm.weight, eps)
    return F.linear(h, cast("torch.Tensor", head.weight))
