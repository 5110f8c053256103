"""Host words on their way to the device: a pinned buffer in named regions with a device twin, reused step after
step, or a one-off pinned copy where no buffer is kept."""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """One host buffer of `dtype` (pinned on CUDA) cut into named regions, with a device twin on CUDA.

    A region is refilled only once its last upload has finished (an event per region), so a plan that
    reads nothing back cannot have its bytes overwritten by the next one mid-copy. On the CPU the host
    buffer is the device buffer and nothing is copied. Nothing is allocated after construction: a pinned
    allocation on the step path cost 3-7 ms of host time (the prefill batch's, H100 host), with the GPU idle
    when it had nothing else queued.
    """

    def __init__(
        self, regions: dict[str, int], device: torch.device, dtype: torch.dtype = torch.int32
    ) -> None:
        self._cuda = device.type == "cuda"
        total = sum(regions.values())
        self._host = torch.zeros(total, dtype=dtype, pin_memory=self._cuda)
        self._twin = torch.zeros(total, dtype=dtype, device=device) if self._cuda else self._host
        self._host_np = self._host.numpy()
        self._bounds: dict[str, tuple[int, int]] = {}
        self._uploaded: dict[str, torch.cuda.Event] = {}
        # Uploads run on the step thread's stream, the device's default one; named in each record, since
        # finding the current stream costs a record ~20 µs of Python.
        self._stream = torch.cuda.default_stream(device) if self._cuda else None
        start = 0
        for name, words in regions.items():
            self._bounds[name] = (start, words)
            if self._cuda:
                self._uploaded[name] = torch.cuda.Event()
            start += words

    def capacity(self, region: str) -> int:
        return self._bounds[region][1]

    def host(self, region: str) -> np.ndarray:
        """The region's host words, free to fill (waits only for this region's previous upload)."""
        start, words = self._bounds[region]
        if self._cuda:
            self._uploaded[region].synchronize()
        return self._host_np[start : start + words]

    def device(self, region: str) -> torch.Tensor:
        """The whole region on the device (the host buffer itself on the CPU), at a fixed address."""
        start, words = self._bounds[region]
        return self._twin[start : start + words]

    def upload(self, region: str, words: int) -> torch.Tensor:
        """The first `words` of the region on the device (one non-blocking copy on CUDA)."""
        start, capacity = self._bounds[region]
        if words > capacity:
            raise ValueError(f"{words} words do not fit the {region} staging of {capacity}")
        if not self._cuda:
            return self._host[start : start + words]
        staged = self._twin[start : start + words]
        staged.copy_(self._host[start : start + words], non_blocking=True)
        self._uploaded[region].record(self._stream)
        return staged

    def put(self, region: str, words: np.ndarray) -> torch.Tensor:
        """`words` copied into the region and uploaded: their device view, at the region's fixed address."""
        if len(words) > self.capacity(region):
            raise ValueError(f"{len(words)} words do not fit the {region} staging of {self.capacity(region)}")
        self.host(region)[: len(words)] = words
        return self.upload(region, len(words))


def upload_once(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """`words` on the device in a buffer of their own: from a one-off pinned copy on CUDA (queued without a wait;
    the caching host allocator keeps the block till the copy has run), the host array itself elsewhere."""
    host = torch.from_numpy(words)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
