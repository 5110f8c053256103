"""The greedy tokens of a packed 8-bit head (packed_argmax.c): the argmax of its logits, found with few of them
computed in full. A greedy decode step's head reads the same bytes as before with a fraction of the work."""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import nn

from executor_svc.c_kernels import build_or_none
from executor_svc.models.packed import GROUP, PackedWeight
from executor_svc.models.packed_kernel import FLAGS

_SOURCE = os.path.join(os.path.dirname(__file__), "packed_argmax.c")


@functools.cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The kernel built with `flags` (this machine's own by default), or None (logged) where it cannot be."""
    lib = build_or_none(_SOURCE, flags, "greedy steps take the argmax of every logit")
    if lib is None:
        return None
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.packed_group_l1.argtypes = [ptr, i64, i64, ptr, c_int]
    lib.packed_argmax.argtypes = [c_int, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, c_int]
    return lib


class GreedyHead:
    """An output head's packed weight with its groups' sums of |q|, for `tokens`."""

    def __init__(self, weight: PackedWeight, l1: torch.Tensor) -> None:
        self.weight = weight
        self.l1 = l1  # uint16 [N, K / GROUP]: sum of |q| over each group
        self._work = torch.empty(0)

    @staticmethod
    def of(head: nn.Module) -> GreedyHead | None:
        """For an output head module (a linear layer, or the embedding a head is tied to) with a packed weight
        and no bias, where `over` serves it."""
        weight = getattr(head, "packed", None)
        return GreedyHead.over(weight) if weight is not None and getattr(head, "bias", None) is None else None

    @staticmethod
    def over(weight: PackedWeight) -> GreedyHead | None:
        """The head for `weight`, or None where the kernel does not serve it: 8 bits with no offset and no
        minimums (gguf's Q8_0) and no q of -128, a kernel that builds."""
        lib = library()
        if lib is None or weight.bits != 8 or weight.offset or weight.minv is not None:
            return None
        n, k = weight.shape
        l1 = torch.empty(n, k // GROUP, dtype=torch.int16)  # as uint16: torch has no such dtype to fill
        if lib.packed_group_l1(weight.q.data_ptr(), n, k, l1.data_ptr(), torch.get_num_threads()):
            return None
        return GreedyHead(weight, l1)

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """int64 [1]: the argmax of x[1, K] @ w^T along N, as the packed matmul's logits would give it; None
        where it does not serve (another number of rows, a row not finite): take the logits then."""
        lib = library()
        if lib is None or x.shape[0] != 1 or x.dtype != torch.float32:
            return None
        x = x.contiguous()
        w = self.weight
        n, k = w.shape
        groups = k // GROUP
        need = 2 * ((groups + 1) // 2) + groups + n + k // 4  # packed_argmax.c's work, in floats
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        token = torch.empty(1, dtype=torch.int64)
        failed = lib.packed_argmax(
            w.scale.dtype == torch.float16,
            w.q.data_ptr(),
            w.scale.data_ptr(),
            self.l1.data_ptr(),
            n,
            k,
            x.data_ptr(),
            self._work.data_ptr(),
            token.data_ptr(),
            torch.get_num_threads(),
        )
        return None if failed else token
