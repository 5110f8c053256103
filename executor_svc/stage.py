"""This process's stage of a layer split: its layer range, and the torch.distributed point-to-point transfers
of a step with the stages beside it (hidden states forward, the sampled tokens from the last stage back to the
first, which loops them back as the next step's input).

Every stage applies the same plan, so each knows every transfer's shape without being told: a decode step's
rows are its bucket, a prefill batch's its tokens and sampling chunks. Transfers go on the process group's
backend: NCCL between GPUs, gloo on the CPU, or gloo through host memory between processes on one GPU (NCCL
refuses two ranks on one device). A whole model is the stage [0, num_layers) with no group.

Each transfer goes behind a header naming its step (the stream's planner, the plan's seq, the payload's size),
on a gloo group of its own, checked on the host before the payload is read: a stream cancelled mid-step (its
planner timed the group out as hung) can leave one stage having run a plan that another never read, and the
next stream's transfers would then each read the step before's (wrong tokens, or gloo aborting on a size
mismatch). A stage that finds the group out of step so raises StageLost: the group is lost and restarts.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from protos.layer_split import LayerRange

if TYPE_CHECKING:
    from executor_svc.config import ExecutorConfig

StageOf = Callable[[int], "Stage"]  # the model's layer count -> this process's stage

BACKENDS = ("auto", "gloo", "nccl")
# A stage that waits this long for its neighbour's transfer gives up (the step fails, the group is lost).
TRANSFER_TIMEOUT = datetime.timedelta(seconds=120)
HEARTBEAT_S = 1.0  # between the stages' liveness barriers
# A stage whose transfer failed exits this long after, whether or not a stream reports it: the step may be one
# of a stream already ended, whose failure nobody collects (a stream that does exits sooner, having said why).
LOST_EXIT_S = 1.0


class StageLost(Exception):
    """A transfer with another stage failed, or found the stages out of step: that stage is gone, or the group
    cannot be trusted, and the group is lost (a process group cannot take a restarted rank back, so every
    stage of it restarts)."""


class Stage:
    """The layer range a model builds, and (split) the transfers between stages, in step order."""

    def __init__(self, layers: LayerRange, rank: int = 0, stages: int = 1, backend: str = "") -> None:
        self.layers = layers
        self.rank, self.stages = rank, stages
        self.group_id = ""  # the torch.distributed group joined (`join`); "" for a whole model
        self.backend = backend  # "" = no group (a whole model)
        self._via_host = False  # gloo between processes on GPUs: tensors cross through host memory
        self._host_group: dist.ProcessGroup | None = None
        self._heartbeat_group: dist.ProcessGroup | None = None
        self._step_group: dist.ProcessGroup | None = None  # the transfers' headers
        self._on_lost: Callable[[str], None] | None = None
        # The step whose transfers run, as their headers name it: the stream's (stream_tag of its planner), set
        # as a stream opens, and the plan's seq, set as it launches; both on the thread that runs the steps.
        self.stream = 0
        self.seq = 0

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(LayerRange.whole(num_layers))

    @property
    def split(self) -> bool:
        return self.stages > 1

    @classmethod
    def join(
        cls, layers: LayerRange, rank: int, stages: int, address: str, backend: str, device: torch.device
    ) -> Stage:
        """Join the stage group at `address` (HOST:PORT, where rank 0 listens): blocks until every stage
        has joined. `backend` auto: NCCL on CUDA, gloo on the CPU."""
        if backend not in BACKENDS:
            raise ValueError(f"stage backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < stages:
            raise ValueError(f"stage rank {rank} is outside the group of {stages}")
        if (rank == 0) != layers.first or (rank == stages - 1) != layers.last:
            raise ValueError(
                f"stage {rank} of {stages} holds layers {layers.begin}:{layers.end}: the first stage must "
                f"start at layer 0 and only the last may end at the model's {layers.num_layers}"
            )
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the nccl backend needs CUDA devices, not {device}")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=stages,
            timeout=TRANSFER_TIMEOUT,
            device_id=device if backend == "nccl" else None,
        )
        stage = cls(layers, rank, stages, backend)
        stage._via_host = backend == "gloo" and device.type == "cuda"
        # Parked pages cross on a group of their own, on the host, from the page-copy thread: apart from the
        # steps' transfers on the step thread.
        # Their timeout is the transfers' (torch's default is 30 min): a stage that never answers fails them.
        stage._host_group = dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT)
        stage._heartbeat_group = dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT)
        stage._step_group = dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT)
        # The group's name, drawn by rank 0: a planner checks that the stages it lists as a group joined one.
        drawn = torch.tensor([secrets.randbits(63) if rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(drawn, src=0, group=stage._host_group)
        stage.group_id = f"{int(drawn[0]):016x}"
        return stage

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Calls on_lost(why) from a thread of its own once another stage is gone: a barrier on a group of its
        own every HEARTBEAT_S fails at once when a stage's process died (its connections close), so a stage
        that is idle learns it too, and exits to restart with its group. So does a failed transfer, LOST_EXIT_S
        after it, seen or not."""
        self._on_lost = on_lost
        group = self._heartbeat_group

        def beat() -> None:
            while True:
                try:
                    dist.barrier(group=group)
                except RuntimeError as error:
                    on_lost(f"stage {self.rank}: the group's heartbeat failed: {error}")
                    return
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=beat, name="stage-heartbeat", daemon=True).start()

    def leave(self) -> None:
        """Leave the group (at the executor's end)."""
        if self.split and dist.is_initialized():
            dist.destroy_process_group()

    def _lost(self, why: str) -> StageLost:
        """StageLost(why), this stage's exit LOST_EXIT_S from now armed (once watched)."""
        if self._on_lost is not None:
            timer = threading.Timer(LOST_EXIT_S, self._on_lost, (why,))
            timer.daemon = True
            timer.start()
        return StageLost(why)

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        header = torch.tensor([self.stream, self.seq, tensor.numel()], dtype=torch.int64)
        try:
            dist.send(header, dst=to, group=self._step_group)
            dist.send(tensor.cpu() if self._via_host else tensor.contiguous(), dst=to)
        except RuntimeError as error:  # gloo and NCCL raise RuntimeError (DistBackendError) for a lost peer
            raise self._lost(f"stage {self.rank}: sending to stage {to} failed: {error}") from error

    def _receive(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int
    ) -> torch.Tensor:
        header = torch.empty(3, dtype=torch.int64)
        buffer = torch.empty(shape, dtype=dtype, device="cpu" if self._via_host else device)
        try:
            dist.recv(header, src=src, group=self._step_group)
            stream, seq, size = header.tolist()
            if (stream, seq, size) != (self.stream, self.seq, math.prod(shape)):
                # The payload behind it is left unread: the group is lost either way.
                raise self._lost(
                    f"stage {self.rank}: stage {src} sent step {seq} (stream {stream:x}, {size} values) while "
                    f"this stage runs step {self.seq} (stream {self.stream:x}, {math.prod(shape)} values): the "
                    "stages are out of step (a stream ended mid-step on one and not the other)"
                )
            dist.recv(buffer, src=src)
        except RuntimeError as error:
            raise self._lost(f"stage {self.rank}: receiving from stage {src} failed: {error}") from error
        return buffer.to(device, non_blocking=True)

    def enter(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A later stage's input: the previous stage's hidden states x[rows, hidden]."""
        return self._receive((rows, hidden), dtype, device, self.rank - 1)

    def first_input(
        self,
        embedding: Callable[[torch.Tensor], torch.Tensor] | None,
        tokens: torch.Tensor,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """x[B, hidden]: the tokens' embeddings on the first stage, the previous stage's output on a later one."""
        if self.layers.first:
            assert embedding is not None, "the first stage holds the embedding"
            return embedding(tokens)
        return self.enter(tokens.shape[0], hidden, dtype, device)

    def hand_on(self, x: torch.Tensor) -> None:
        """An earlier stage's output x[rows, hidden], to the next stage."""
        self._send(x, self.rank + 1)

    def gather_shards(
        self, shards: list[tuple[int, int]], blobs: list[bytes] | None
    ) -> tuple[list[tuple[int, int]], list[bytes]] | None:
        """A park's shards, every stage's, at the first stage (the others return None), in layer order.
        `blobs` None: this stage could not read its pages; the first stage then raises, having taken what
        the others sent (so the next park's transfers stay in step). Parks run one at a time, in the same
        order on every stage (the planner's group link sees to it). A transfer that fails (a stage gone) raises
        StageLost, as a step's does."""
        group, peer = self._host_group, 0
        all_shards, all_blobs, failed = list(shards), list(blobs or []), [] if blobs is not None else [0]
        try:
            if not self.layers.first:
                header = _shards_header(shards, blobs) if blobs is not None else torch.tensor([-1])
                dist.send(torch.tensor([len(header)]), dst=0, group=group)
                dist.send(header, dst=0, group=group)
                if blobs is not None:
                    data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
                    dist.send(data, dst=0, group=group)
                return None
            for peer in range(1, self.stages):
                length = torch.empty(1, dtype=torch.int64)
                dist.recv(length, src=peer, group=group)
                header = torch.empty(int(length), dtype=torch.int64)
                dist.recv(header, src=peer, group=group)
                if header[0] < 0:
                    failed.append(peer)
                    continue
                words = header[1:].view(-1, 3).tolist()
                data = torch.empty(sum(size for _, _, size in words), dtype=torch.uint8)
                dist.recv(data, src=peer, group=group)
                raw, offset = data.numpy().tobytes(), 0
                for begin, end, size in words:
                    all_shards.append((begin, end))
                    all_blobs.append(raw[offset : offset + size])
                    offset += size
        except RuntimeError as error:  # gloo raises RuntimeError for a lost peer
            raise self._lost(
                f"stage {self.rank}: a park's transfer with stage {peer} failed: {error}"
            ) from error
        if failed:
            raise RuntimeError(f"stages {failed} could not read their pages: the park is incomplete")
        return all_shards, all_blobs

    def loop_back(self, tokens: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
        """The step's sampled tokens i64[rows] at every stage that needs them: the last stage sampled them
        and sends them to the first, whose next step reads them as its input; a middle stage gets zeros
        (it never embeds a token)."""
        if self.layers.last:
            assert tokens is not None, "the last stage samples"
            if self.split and rows:
                self._send(tokens, 0)
            return tokens
        if rows and self.layers.first:
            return self._receive((rows,), torch.int64, device, self.stages - 1)
        return torch.zeros(rows, dtype=torch.int64, device=device)


def stage_of(config: ExecutorConfig, device: torch.device) -> StageOf | None:
    """What the loader calls once it knows the model's layer count: the stage config.layers asks for (joining
    its group when split); None for the whole model."""
    if config.layers is None:
        return None
    begin, end = config.layers
    if config.stages == 1:

        def whole(num_layers: int) -> Stage:
            if (begin, end) != (0, num_layers):
                raise ValueError(f"a single stage holds the whole model (0:{num_layers}), not {begin}:{end}")
            return Stage.whole(num_layers)

        return whole
    address, backend = config.stage_group or "", config.stage_backend

    def join(num_layers: int) -> Stage:
        layers = LayerRange(begin, end, num_layers)
        return Stage.join(layers, config.stage_rank, config.stages, address, backend, device)

    return join


def stream_tag(planner: str) -> int:
    """The tag of a Steps stream opened by `planner` (its id; "" for none) in the transfers' headers: a planner
    numbers its plans from 0, so a seq alone could name a step of the planner before a restart."""
    return int.from_bytes(hashlib.blake2b(planner.encode(), digest_size=7).digest()) if planner else 0


def _shards_header(shards: list[tuple[int, int]], blobs: list[bytes]) -> torch.Tensor:
    """i64[1 + 3 k]: k, then (begin, end, bytes) of each shard; k = -1 says the stage could not read them."""
    words = [len(shards)] + [
        n for (begin, end), blob in zip(shards, blobs, strict=True) for n in (begin, end, len(blob))
    ]
    return torch.tensor(words, dtype=torch.int64)
