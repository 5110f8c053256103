"""The recurrent-state pool: for each gated delta net layer, the conv window and the recurrent state of one
request per slot (DESIGN §5); slot 0 is the sink slot. And what a step tells the recurrent layers: which
slot each of its sequences reads and writes."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np
import structlog
import torch

if TYPE_CHECKING:
    from executor_svc.kernels.gated_delta_fla import Packed

log = structlog.get_logger("deltaserve.executor.state_pool")

SINK_SLOT = 0


class StatePool:
    """`conv`: [layers, slots, channels, conv_width - 1] in the model's dtype; `recurrent`: [layers, slots,
    heads, value_dim, key_dim] in float32 (the state accumulates over the whole sequence), value-major: a
    value's row of keys is contiguous, so a decode program's block of values is one run of memory (fla's
    `state_v_first` layout, FlashInfer's "k-last").

    Padding rows read the sink slot and write zeros back into it, so it stays zero: nothing else writes it.
    No layers is a stage of a layer split holding full-attention layers only: its slots are numbers the
    planner hands out to every stage alike, with no state here.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        channels: int,
        conv_width: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_layers < 0:
            raise ValueError(f"a state pool's layers must not be negative, got {num_layers}")
        if num_slots < 2:
            raise ValueError(f"state slots must be at least 2 (slot 0 is the sink slot), got {num_slots}")
        if conv_width < 2:
            raise ValueError(f"conv_width must be at least 2, got {conv_width}")
        self.conv = torch.zeros(num_layers, num_slots, channels, conv_width - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            num_layers, num_slots, heads, value_dim, key_dim, dtype=torch.float32, device=device
        )

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def num_layers(self) -> int:
        return self.conv.shape[0]

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    @property
    def slot_nbytes(self) -> int:
        """What one slot holds over every layer."""
        return self.nbytes // self.num_slots

    def copy(self, pairs: np.ndarray) -> None:
        """state[dst] = state[src] for each (src, dst) row of pairs int[n, 2], every layer (a checkpoint's
        copy, or its restore)."""
        if len(pairs) == 0:
            return
        index = torch.from_numpy(np.asarray(pairs, dtype=np.int64))
        if self.conv.device.type == "cuda":  # pinned: queued without waiting for the steps launched before
            index = index.pin_memory()
        index = index.to(self.conv.device, non_blocking=True)
        src, dst = index[:, 0], index[:, 1]
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]


class StateInputs(NamedTuple):
    """Which states a step's recurrent layers read and write.

    Decode (`seq_starts` None): row b is one token of the sequence whose state is at slots[b] (0: padding).
    Prefill: sequence i is tokens [seq_starts[i], seq_starts[i + 1]) of the batch, its state at slots[i],
    `fresh[i]` when it starts at position 0 (its state starts from zeros, whatever the slot held).
    """

    pool: StatePool
    slots: torch.Tensor  # i64[N], on the pool's device
    seq_starts: np.ndarray | None = None  # int64[N + 1], host
    host_slots: np.ndarray | None = None  # int64[N]: slots, on the host (prefill)
    fresh: np.ndarray | None = None  # bool[N], host
    packed: Packed | None = None  # prefill on CUDA: the sequences' index on the device (None: made per step)


@runtime_checkable
class RecurrentModel(Protocol):
    """A model with recurrent layers: it says how large one slot of its state pool is, and makes the pool."""

    def make_state_pool(self, num_slots: int, device: torch.device | str | None = None) -> StatePool: ...


def make_state_pool(model: object, slots: int | None, widest_bucket: int) -> StatePool | None:
    """The state pool of a model with recurrent layers (None for one without), `slots` of them with the sink
    (None: 2 * widest_bucket + 1, one for every row the slot store holds), logged with its bytes."""
    if not isinstance(model, RecurrentModel):
        return None
    slots = 2 * widest_bucket + 1 if slots is None else slots
    pool = model.make_state_pool(slots)
    log.info(
        f"state pool: {pool.num_slots} slots (slot 0 the sink) x {pool.num_layers} recurrent layers, "
        f"{pool.slot_nbytes / 2**20:.2f} MiB a slot, {pool.nbytes / 2**20:.1f} MiB in all"
    )
    return pool
