"""Telling a failed allocation at start-up apart, and saying it in a line (memory_errors.py), alone."""

from __future__ import annotations

from deltaserve.memory_errors import memory_detail, out_of_memory

CPU = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 36864000000000 bytes. Error code 12 (Cannot allocate memory)"
)
CUDA = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which ..."


class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name, without importing torch
    pass


def test_allocations_that_failed_are_told_apart():
    assert out_of_memory(RuntimeError(CPU)) and out_of_memory(OutOfMemoryError(CUDA))
    assert out_of_memory(MemoryError("Unable to allocate 7.45 TiB for an array"))
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_the_amount_asked_for_is_said():
    assert memory_detail(RuntimeError(CPU)) == "an allocation of 33.5 TiB failed"
    assert memory_detail(OutOfMemoryError(CUDA)) == "an allocation of 2.00 GiB failed"
    assert (
        memory_detail(RuntimeError("you tried to allocate 3221225472 bytes"))
        == "an allocation of 3.0 GiB failed"
    )
    assert memory_detail(MemoryError()) == "MemoryError"
    assert memory_detail(MemoryError("Unable to allocate 7.45 TiB\nmore")) == "Unable to allocate 7.45 TiB"
