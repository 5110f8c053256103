"""A card's copy stream for park and restore, and its staging: made once, by the first copy (what the restore
guard checks a card has room for), and reused by every later one, so park and restore allocate nothing more
on the card however large the snapshot. And what the guard samples of the card.

A copy goes through the staging in chunks (staging_plan.py): a restore's chunk is filled on the host (its
entries' indices, then its bytes), copied to the card and scattered into the pool; a park's is gathered on
the card, copied to the host and read out. The staging is two halves, so the host fills (or reads) one while
the card copies the other. On the CPU the host halves are the whole staging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from executor_svc.restore_guard import STAGING_BYTES, CardSample
from executor_svc.staging_plan import INDEX_BYTES, Chunk, plan_chunks

FreeMemory = Callable[[], int]  # free bytes of the card; raises RuntimeError when it cannot be sampled


def _entry_bytes(tensor: torch.Tensor) -> int:
    """The bytes of one entry of a tensor [layers, entries, *entry]."""
    return tensor[0, 0].numel() * tensor.element_size()


def _card_views(
    buffer: torch.Tensor, chunk: Chunk, like: torch.Tensor, tensors: int
) -> tuple[torch.Tensor, ...]:
    """A chunk's place in a staging half on the card: its indices i64[entries], then per tensor its part
    [layers, entries, *entry] in `like`'s dtype."""
    begin = chunk.entries * INDEX_BYTES
    data = buffer[begin : begin + tensors * chunk.layers * chunk.entries * _entry_bytes(like)]
    parts = data.view(like.dtype).view(tensors, chunk.layers, chunk.entries, *like.shape[2:])
    return buffer[:begin].view(torch.int64), *parts


def _gather_chunk(srcs: Sequence[torch.Tensor], chunk: Chunk, buffer: torch.Tensor) -> None:
    """The chunk of srcs at the staged indices, into the staging half `buffer` on the card."""
    index, *parts = _card_views(buffer, chunk, srcs[0], len(srcs))
    for src, part in zip(srcs, parts, strict=True):
        torch.index_select(src[chunk.l0 : chunk.l1], 1, index, out=part)


def _scatter_chunk(dsts: Sequence[torch.Tensor], chunk: Chunk, buffer: torch.Tensor) -> None:
    """The staged chunk from `buffer` on the card into dsts at its indices."""
    index, *parts = _card_views(buffer, chunk, dsts[0], len(dsts))
    for dst, part in zip(dsts, parts, strict=True):
        dst[chunk.l0 : chunk.l1].index_copy_(1, index, part)


class CopyStream:
    """The stream and events that park's and restore's copies run on, after the work queued so far on the card
    and before any queued after them, and their staging (`staging_bytes` on the card, as much pinned on the
    host). On the CPU there is no card and no stream (but `free_memory` makes the guard apply as if there were
    one: the CPU tests of a refused restore)."""

    def __init__(
        self, device: torch.device, free_memory: FreeMemory | None = None, staging_bytes: int = STAGING_BYTES
    ) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._half_bytes = staging_bytes // (2 * INDEX_BYTES) * INDEX_BYTES  # a half holds whole indices
        if self._half_bytes < 2 * INDEX_BYTES:
            raise ValueError(f"a staging of {staging_bytes} bytes is too small to hold a chunk")
        self._stream: torch.cuda.Stream | None = None
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # before, after the copies
        self._host: list[np.ndarray] = []  # the halves u8[half] on the host (pinned on a card)
        self._host_tensors: list[torch.Tensor] = []  # the same, as tensors
        self._card: list[torch.Tensor] = []  # the halves u8[half] on the card (the host's on the CPU)
        self._copied: list[torch.cuda.Event] = []  # per half: queued after its last copy host <-> card
        if free_memory is None and self._cuda:
            free_memory = self._cuda_free_memory
        self.free_memory = free_memory

    def _cuda_free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    @property
    def staging_nbytes(self) -> int:
        """The staging's bytes on the card once made, whatever the copies (on the host as much again)."""
        return 2 * self._half_bytes

    @property
    def ready(self) -> bool:
        """The stream and the staging exist: a restore allocates nothing more on this card."""
        return bool(self._card)

    def cards(self) -> list[CardSample]:
        """The guard's sample of this card (none on the CPU without a memory query)."""
        if self.free_memory is None:
            return []
        try:
            free: int | None = self.free_memory()
        except RuntimeError:
            free = None  # no sample: go ahead
        return [CardSample(str(self.device), free, self.ready)]

    def _make(self) -> None:
        """The first use on this card: the stream, its events and the staging, made once."""
        self._host_tensors = [
            torch.empty(self._half_bytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)
        ]
        self._host = [half.numpy() for half in self._host_tensors]
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._events = torch.cuda.Event(), torch.cuda.Event()
            self._copied = [torch.cuda.Event(), torch.cuda.Event()]
            self._card = [
                torch.empty(self._half_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        else:
            self._card = self._host_tensors

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """The body's copies run on the copy stream, between the card's work queued before and after (and in
        inference mode, whichever mode the staging was made in)."""
        if not self.ready:
            self._make()
        if not self._cuda:
            with torch.inference_mode():
                yield
            return
        assert self._stream is not None and self._events is not None
        before, after = self._events
        main = torch.cuda.current_stream(self.device)
        before.record(main)
        self._stream.wait_event(before)
        with torch.cuda.stream(self._stream), torch.inference_mode():
            yield
        after.record(self._stream)
        main.wait_event(after)

    def _host_views(
        self, half: int, chunk: Chunk, tensors: int, entry_bytes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A chunk's place in a staging half on the host: its indices i64[entries], then its bytes u8[tensors,
        layers, entries, entry_bytes]."""
        begin = chunk.entries * INDEX_BYTES
        data = self._host[half][begin : begin + tensors * chunk.layers * chunk.entries * entry_bytes]
        return self._host[half][:begin].view(np.int64), data.reshape(
            tensors, chunk.layers, chunk.entries, entry_bytes
        )

    def _to_card(self, half: int, begin: int, end: int) -> None:
        if self._cuda:
            self._card[half][begin:end].copy_(self._host_tensors[half][begin:end], non_blocking=True)

    def _to_host(self, half: int, begin: int, end: int) -> None:
        if self._cuda:
            self._host_tensors[half][begin:end].copy_(self._card[half][begin:end], non_blocking=True)

    def _mark(self, half: int) -> None:
        """After the copies queued so far between the half on the host and on the card."""
        if self._cuda:
            self._copied[half].record()

    def _wait(self, half: int) -> None:
        """Until the half's copies between host and card are done (an event never recorded: at once)."""
        if self._cuda:
            self._copied[half].synchronize()

    def scatter(self, dsts: Sequence[torch.Tensor], src: np.ndarray, index: np.ndarray) -> None:
        """Restore: dsts[t][l, index[e]] = src[l, t, e] for every layer l, tensor t and entry e. `dsts`: tensors
        [layers, N, *entry] of one dtype and entry shape on the card; `src`: u8[layers, len(dsts), entries,
        entry bytes] on the host. Queued on the copy stream; the card's work queued after it waits for it."""
        layers, tensors, entries, entry_bytes = src.shape
        if tensors != len(dsts) or entry_bytes != _entry_bytes(dsts[0]):
            raise ValueError(
                f"{src.shape[1]} tensors of {entry_bytes}-byte entries staged for {len(dsts)} of {_entry_bytes(dsts[0])}"
            )
        with self._copying():
            for n, chunk in enumerate(plan_chunks(layers, entries, tensors * entry_bytes, self._half_bytes)):
                half = n % 2
                self._wait(half)  # its last chunk is on the card: the host half may be filled again
                host_index, host_data = self._host_views(half, chunk, tensors, entry_bytes)
                host_index[:] = index[chunk.e0 : chunk.e1]
                host_data[:] = src[chunk.l0 : chunk.l1, :, chunk.e0 : chunk.e1].transpose(1, 0, 2, 3)
                self._to_card(half, 0, chunk.nbytes(tensors * entry_bytes))
                self._mark(half)
                _scatter_chunk(dsts, chunk, self._card[half])

    def gather(self, srcs: Sequence[torch.Tensor], index: np.ndarray) -> np.ndarray:
        """Park: u8[layers, len(srcs), entries, entry bytes] on the host, holding srcs[t][l, index[e]] at
        [l, t, e]; `srcs`: tensors [layers, N, *entry] of one dtype and entry shape on the card."""
        tensors, entry_bytes = len(srcs), _entry_bytes(srcs[0])
        out = np.empty((srcs[0].shape[0], tensors, len(index), entry_bytes), dtype=np.uint8)
        chunks = plan_chunks(out.shape[0], len(index), tensors * entry_bytes, self._half_bytes)

        def read_out(n: int) -> None:  # chunk n, once on the host, into out
            chunk, half = chunks[n], n % 2
            self._wait(half)
            data = self._host_views(half, chunk, tensors, entry_bytes)[1]
            out[chunk.l0 : chunk.l1, :, chunk.e0 : chunk.e1] = data.transpose(1, 0, 2, 3)

        with self._copying():
            for n, chunk in enumerate(chunks):
                half, begin = n % 2, chunk.entries * INDEX_BYTES
                self._host_views(half, chunk, tensors, entry_bytes)[0][:] = index[chunk.e0 : chunk.e1]
                self._to_card(half, 0, begin)
                _gather_chunk(srcs, chunk, self._card[half])
                self._to_host(half, begin, chunk.nbytes(tensors * entry_bytes))
                self._mark(half)
                if n:
                    read_out(n - 1)  # the host reads the last chunk while the card copies this one
            if chunks:
                read_out(len(chunks) - 1)
        return out

    def warm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Loads the copy kernels for these tensors [layers, N, *entry] now, at the executor's start, on the
        current stream and outside the staging: a kernel's first launch loads its code onto the card, which a
        restore must not (the guard counts the stream and the staging only). Copies entry 0 (the sink page)
        onto itself."""
        layer_entry_bytes = len(tensors) * _entry_bytes(tensors[0])
        chunk = plan_chunks(tensors[0].shape[0], 1, layer_entry_bytes, self._half_bytes)[0]
        buffer = torch.zeros(
            chunk.nbytes(layer_entry_bytes), dtype=torch.uint8, device=self.device
        )  # index 0
        with torch.inference_mode():
            _gather_chunk(tensors, chunk, buffer)
            _scatter_chunk(tensors, chunk, buffer)
