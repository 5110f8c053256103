"""What every family's model shares as the stage of a layer split it is built for (the whole model by default):
its config, device and dtype, the stage, a KV pool sized to the stage's attention layers, and the stage's input."""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch import nn

from executor_svc.kv_pool import KVPool
from executor_svc.models.family import ModelConfig
from executor_svc.stage import Stage

ConfigT = TypeVar("ConfigT", bound=ModelConfig)


class StagedModel(nn.Module, Generic[ConfigT]):
    """A stage holds its layers only (renumbered from 0) and the ends its LayerRange says: the embedding (a
    module that maps tokens) on the first, and on the last the final norm and head (the embedding again where
    the head is tied to it)."""

    embed_tokens: nn.Module | None

    def __init__(
        self, config: ConfigT, device: torch.device | str, dtype: torch.dtype, stage: Stage | None
    ) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.stage = Stage.whole(config.num_layers) if stage is None else stage
        self.scale = config.head_dim**-0.5  # attention's softmax scale

    @property
    def kv_layers(self) -> int:
        """This stage's layers that keep K and V in the pool."""
        raise NotImplementedError

    def make_kv_pool(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVPool:
        cfg = self.config
        return KVPool(
            self.kv_layers,
            num_pages,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            device=self.device if device is None else device,
        )

    def enter(self, tokens: torch.Tensor) -> torch.Tensor:
        """x[B, hidden]: the tokens' embeddings on the first stage, the previous stage's output on a later one."""
        return self.stage.first_input(
            self.embed_tokens, tokens, self.config.hidden_size, self.dtype, self.device
        )
