"""The attention backends: what the model calls for attention, over KV pages read by slot or by chunk.

A backend says how a forward runs: `fused` picks the layer's other ops (the Triton kernels, or torch ops),
and a decode backend also makes the step's inputs. The model knows nothing more of what step it is in.

- torch_ref: plain torch over block tables (the CPU path and the reference).
- resident: Triton kernels that read each row off the slot store on the device, host-plan-free.
- host_planned: a host copy of the rows, page lists planned on the host every step (FlashInfer on CUDA).
- prefill: a packed prefill batch's causal attention (Triton in one launch a layer, or torch chunk by chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from executor_svc.kv_pool import KVPool
    from executor_svc.models.family import ExecutorModel
    from executor_svc.plan import CheckedPlan
    from executor_svc.slot_store import SlotStore
    from executor_svc.state_pool import StateInputs


class StepInputs(NamedTuple):
    """One position for each of B rows: a decode step's rows, or a packed prefill batch's tokens."""

    tokens: torch.Tensor  # i64[B]
    positions: torch.Tensor  # i64[B]
    kv_lens: torch.Tensor  # i32[B]: stored length before the step (a prefill token's is its position)
    write_page: torch.Tensor  # i32[B]: the page the position's K/V goes to
    write_offset: torch.Tensor  # i32[B]: its offset in that page
    states: StateInputs | None = None  # the recurrent layers' state slots (None: a model without any)


class Attention(Protocol):
    """What the model calls: the attention of one layer over the pool's pages."""

    kv: KVPool
    fused: bool  # True: the model runs the rest of the layer in the Triton kernels; False: in torch ops

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q[B, H, D] -> [B, H, D], the K/V of this step's positions already written."""
        ...


class DecodeAttention(Attention, Protocol):
    """A decode step's attention. The host calls `plan` with every plan and `prepare` before a decode step;
    the step body (captured or eager) calls `inputs` then the model; the host calls `stepped` after it."""

    kind: str  # what the capture log says of it

    def plan(self, plan: CheckedPlan) -> None:
        """Take note of a plan's row writes (a host-planned backend keeps its host copy of the rows)."""
        ...

    def prepare(self, bucket: int) -> None:
        """The host's work before the bucket's step (a host-planned backend plans the attention here)."""
        ...

    def inputs(self, bucket: int) -> StepInputs:
        """The step's inputs, on the device, inside the step body: no host reads, no host work per step."""
        ...

    def stepped(self, bucket: int) -> None:
        """After the step is launched: each real row's length has grown by one."""
        ...


DECODE_ATTENTION = ("torch", "resident", "host-planned")


def decode_attention(
    kind: str, model: ExecutorModel, kv: KVPool, store: SlotStore, buckets: tuple[int, ...], max_seq_len: int
) -> DecodeAttention:
    """The decode attention of one kind: torch (the CPU path), resident (Triton, host-plan-free) or
    host-planned (FlashInfer on CUDA, torch block tables elsewhere). Imported here, on demand: the Triton
    and FlashInfer ones need their packages."""
    config = model.config
    if kind == "torch":
        from executor_svc.attention.torch_ref import TorchDecode

        return TorchDecode(store, kv, model.scale, max_seq_len)
    if kind == "resident":
        from executor_svc.attention.resident import ResidentDecode

        return ResidentDecode(
            store, kv, model.scale, buckets, num_kv_heads=config.num_kv_heads, max_seq_len=max_seq_len
        )
    if kind == "host-planned":
        from executor_svc.attention.host_planned import HostPlannedDecode

        return HostPlannedDecode(store, kv, model.scale, buckets, config.num_heads, max_seq_len)
    raise ValueError(f"decode attention must be one of {DECODE_ATTENTION}, got {kind!r}")
