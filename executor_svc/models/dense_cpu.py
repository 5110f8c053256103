"""The dense decoder's CPU step in one C call (dense_cpu.c): every layer of up to MAX_ROWS rows a call with
packed, fused projections, its attention read in place off the pages. The torch layers cost about 30 torch ops a
layer (18 ms a step for SmolLM2 on one core, more than its matmuls); the call costs none. A decode step's rows
take one call; a short prefill's tokens (each a row whose stored length is its position) MAX_ROWS a call.

The torch layers stay the path for everything else (long prefills, wide decode steps, float weights, other pools)
and the reference the C step is checked against (tests/test_dense_cpu.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

import torch

from executor_svc.c_kernels import build_or_none
from executor_svc.models.packed import PackedLinear, PackedWeight
from executor_svc.models.packed_kernel import FLAGS, MAX_ROWS

if TYPE_CHECKING:
    from executor_svc.attention import StepInputs
    from executor_svc.kv_pool import KVPool
    from executor_svc.models.dense import DenseLayer, DenseModel

_SOURCE = os.path.join(os.path.dirname(__file__), "dense_cpu.c")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Packed(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int32),
        ("offset", ctypes.c_int32),
        ("half", ctypes.c_int32),
        ("q", _ptr),
        ("scale", _ptr),
        ("minv", _ptr),
        ("bias", _ptr),
        ("n", _i64),
        ("k", _i64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qkv", _Packed),
        ("o", _Packed),
        ("gate_up", _Packed),
        ("down", _Packed),
        ("k_pages", _ptr),
        ("v_pages", _ptr),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("page_size", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("rope_cos", _ptr),
        ("rope_sin", _ptr),
    ]


# dense_decode_layers': shape, layers, count, x, batch, positions, write page, offset, tables, stride, lengths,
# scratch, threads
_STEP_ARGS = (_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, ctypes.c_int)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built step, or None (logged once) where it cannot be built: the torch layers serve."""
    lib = build_or_none(_SOURCE, FLAGS, "the CPU decode step runs in torch ops")
    if lib is None:
        return None
    lib.dense_decode_layers.argtypes = _STEP_ARGS
    lib.dense_scratch_floats.argtypes = [_ptr, _i64, ctypes.c_int]
    lib.dense_scratch_floats.restype = _i64
    return lib


def _packed(linear: object) -> _Packed | None:
    if not isinstance(linear, PackedLinear):
        return None
    w: PackedWeight = linear.packed
    bias = 0 if linear.bias is None else linear.bias.data_ptr()
    n, k = w.shape
    half = w.scale.dtype == torch.float16
    minv = 0 if w.minv is None else w.minv.data_ptr()
    return _Packed(w.bits, w.offset, half, w.q.data_ptr(), w.scale.data_ptr(), minv, bias, n, k)


def _layer(layer: DenseLayer, kv: KVPool, index: int) -> _Layer | None:
    attn, mlp = layer.self_attn, layer.mlp
    parts = [_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in parts):
        return None
    qkv, o, gate_up, down = parts
    q_norm = 0 if attn.q_norm is None else attn.q_norm.weight.data_ptr()
    k_norm = 0 if attn.k_norm is None else attn.k_norm.weight.data_ptr()
    k_pages, v_pages = kv.k[index], kv.v[index]
    return _Layer(
        layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
        q_norm,
        k_norm,
        qkv,
        o,
        gate_up,
        down,
        k_pages.data_ptr(),
        v_pages.data_ptr(),
    )


class CpuDecodeLayers:
    """The C step's view of one model over one KV pool: pointers to its weights and pages, made once."""

    def __init__(self, model: DenseModel, kv: KVPool, layers: list[_Layer]) -> None:
        cfg = model.config
        self.kv = kv
        self.layers = (_Layer * len(layers))(*layers)
        self.shape = _Shape(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            kv.page_size,
            cfg.rms_eps,
            model.scale,
            model.rope_cos.data_ptr(),
            model.rope_sin.data_ptr(),
        )
        self._scratch = torch.empty(0)

    @staticmethod
    def over(model: DenseModel, kv: KVPool) -> CpuDecodeLayers | None:
        """The step for this model and pool, or None where it cannot serve them: a float32 CPU model whose
        every layer has packed, fused projections, a contiguous float32 CPU pool, and the C step built."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or kv.k.dtype != torch.float32:
            return None
        if kv.k.device.type != "cpu" or not kv.k.is_contiguous() or not kv.v.is_contiguous():
            return None
        layers = [_layer(layer, kv, i) for i, layer in enumerate(model.decoder_layers())]
        if not layers or any(layer is None for layer in layers) or library() is None:
            return None
        return CpuDecodeLayers(model, kv, [layer for layer in layers if layer is not None])

    def run(
        self, x: torch.Tensor, inputs: StepInputs, tables: torch.Tensor, attn_lens: torch.Tensor
    ) -> torch.Tensor:
        """x[B, hidden] float32 through every layer, in place (returned); each row's K/V written at
        (inputs.write_page, inputs.write_offset) and attended over attn_lens[b] positions of tables[b]. Taken
        MAX_ROWS rows a call, in order: a prefill's tokens (rows of one sequence, positions rising) see the K/V
        of every token before them, as a call writes its rows' K/V before any of them attends."""
        lib = library()
        assert lib is not None and x.shape[0] > 0 and x.is_contiguous()
        threads = torch.get_num_threads()
        need = lib.dense_scratch_floats(ctypes.byref(self.shape), min(x.shape[0], MAX_ROWS), threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        # Held in locals until the calls return: the C step reads them by address.
        positions = inputs.positions.to(torch.int64).contiguous()
        write_page = inputs.write_page.to(torch.int32).contiguous()  # a decode step's: i32 already
        write_offset = inputs.write_offset.to(torch.int32).contiguous()
        for first in range(0, x.shape[0], MAX_ROWS):
            batch = min(MAX_ROWS, x.shape[0] - first)
            lib.dense_decode_layers(
                ctypes.byref(self.shape),
                self.layers,
                len(self.layers),
                x[first].data_ptr(),
                batch,
                positions[first].data_ptr(),
                write_page[first].data_ptr(),
                write_offset[first].data_ptr(),
                tables[first].data_ptr(),
                tables.stride(0),
                attn_lens[first].data_ptr(),
                self._scratch.data_ptr(),
                threads,
            )
        return x
