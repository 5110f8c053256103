"""Packed quantized weights: each GGUF block type packs into weights equal to gguf's de-quantized ones bit for bit,
and the packed matmul equals the de-quantized matmul within float32 tolerance, for a decode step's few rows
(the kernel straight off the packed bytes) and a prefill's many (de-quantized tiles)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from executor_svc import c_kernels
from executor_svc.models import packed_kernel
from executor_svc.models.gguf_packing import PACKABLE, pack_gguf
from executor_svc.models.packed import PackedEmbedding, PackedLinear, PackedWeight

ROWS, COLS = 83, 512  # COLS: two K-quant super-blocks; ROWS: not a multiple of the kernel's block of 4
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")  # gguf's numpy quantizers; the rest get random blocks


def _blocks(type_name: str, seed: int) -> np.ndarray:
    """A [ROWS, COLS] matrix's GGUF blocks: gguf's own quantization of a random matrix where gguf has one, else
    random block bytes with sane float16 scales (the K-quants)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    if type_name in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block_size, block_bytes), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.011).tobytes(), np.uint8)  # d
    raw[..., 2:4] = np.frombuffer(np.float16(0.023).tobytes(), np.uint8)  # dmin
    return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not packed_kernel.available():
        pytest.skip("no C compiler to build the packed-weight kernel")


@pytest.mark.parametrize("type_name", sorted(PACKABLE))
def test_packed_weights_equal_gguf_dequantized(type_name):
    raw = _blocks(type_name, seed=1)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    packed = pack_gguf(raw, type_name, ROWS, COLS)
    assert packed.shape == (ROWS, COLS)
    assert packed.nbytes < reference.nbytes / 3, "packed, not a float copy"
    assert np.array_equal(packed.dequantize_rows().numpy(), reference)
    rows = torch.tensor([5, 0, 82, 5])
    assert torch.equal(packed.dequantize_rows(rows), torch.from_numpy(reference)[rows])


@pytest.mark.parametrize("type_name", sorted(PACKABLE))
@pytest.mark.parametrize("m", [1, 3, packed_kernel.MAX_ROWS, 37])
def test_packed_matmul_equals_dequantized_matmul(type_name, m):
    raw = _blocks(type_name, seed=2)
    dense = torch.from_numpy(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    )
    linear = PackedLinear(pack_gguf(raw, type_name, ROWS, COLS))
    x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(m))
    expected = x.double() @ dense.double().T
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (m, ROWS)
    # float32 sums of 512 products in another order: the error is bounded by the sum of the products' sizes
    bound = x.abs().double() @ dense.abs().double().T
    assert ((got.double() - expected).abs() <= 1e-5 * bound + 1e-30).all()
    # Batched leading axes are kept.
    assert linear(x[None]).shape == (1, m, ROWS)


def test_fused_rows_and_tied_embedding():
    parts = [pack_gguf(_blocks("Q4_1", seed), "Q4_1", ROWS, COLS) for seed in (3, 4)]
    fused = PackedWeight.cat(parts)
    x = torch.randn(2, COLS)
    torch.testing.assert_close(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=1))
    embedding = PackedEmbedding(parts[0])
    ids = torch.tensor([[3, 1], [79, 3]])
    assert torch.equal(embedding(ids), parts[0].dequantize_rows(ids.flatten()).view(2, 2, COLS))
    torch.testing.assert_close(embedding.project(x), parts[0].matmul(x))
    with pytest.raises(ValueError, match="share their format"):
        PackedWeight.cat([parts[0], pack_gguf(_blocks("Q8_0", 5), "Q8_0", ROWS, COLS)])


def test_float16_scales_read_exactly_zero_subnormal_and_negative_included():
    special = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 1e-5, -2.5, 65504.0, 0.011], dtype=torch.float16)
    rows = special.numel()
    q = torch.randint(0, 256, (rows, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for minv in (None, special.flip(0)[:, None]):
        packed = PackedWeight(4, 0, q, special[:, None], minv)
        nibbles = torch.cat([q & 15, q >> 4], dim=1).float()  # element j low nibble, j + 16 high
        expected = nibbles * special.float()[:, None]
        if minv is not None:
            expected = expected + minv.float()
        assert torch.equal(packed.dequantize_rows(), expected)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
        bound = x.abs().double() @ expected.abs().double().t()  # sums in another order
        assert ((packed.matmul(x).double() - x.double() @ expected.double().t()).abs() <= 1e-5 * bound).all()


def test_no_rows_give_no_rows():
    linear = PackedLinear(pack_gguf(_blocks("Q4_1", seed=5), "Q4_1", ROWS, COLS))
    assert linear(torch.randn(0, COLS)).shape == (0, ROWS)
    assert linear(torch.randn(2, 0, COLS)).shape == (2, 0, ROWS)


def test_a_missing_kernel_source_leaves_the_torch_path_serving(tmp_path):
    """A kernel source an install left out is the kernel being unavailable (a warning, the torch path serves),
    never an exception out of the model's load."""
    assert c_kernels.build_or_none(str(tmp_path / "absent.c"), (), "torch") is None


def test_a_compiler_that_cannot_run_leaves_the_torch_path_serving(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert c_kernels.build_or_none(str(source), (), "torch") is None
    assert not list((tmp_path / "cache").rglob("*.so")), "no half-made build left behind"


def test_a_cached_build_that_will_not_load_is_built_again(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # An earlier start built it (another process: one that loaded it may not see its file cut under it).
    earlier = f"from executor_svc import c_kernels; c_kernels.build({str(source)!r}, ())"
    subprocess.run([sys.executable, "-c", earlier], check=True, cwd=Path(__file__).parents[1])
    (built,) = (tmp_path / "cache").rglob("*.so")
    built.write_bytes(b"")  # cut short, as a crash before the file reached the disk leaves it
    assert c_kernels.build(str(source), ()).one() == 1


def test_cc_is_a_program_and_its_arguments(tmp_path, monkeypatch):
    """As make reads $CC: "ccache gcc" or "gcc -m64" name a program and what it is given first."""
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -O1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert c_kernels.build(str(source), ()).one() == 1


def test_a_cc_that_is_no_command_leaves_the_torch_path_serving(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", "gcc '-O1")  # an unbalanced quote
    assert c_kernels.build_or_none(str(source), (), "torch") is None


def test_a_kernel_cache_that_cannot_be_written_leaves_the_torch_path_serving(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "cache"))  # as a home not the user's
    assert c_kernels.build_or_none(str(source), (), "torch") is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64-v2")
def test_the_portable_kernel_is_as_exact_as_the_native_one(monkeypatch):
    """The kernel built without AVX-512 or F16C (its scalar loops and software float16 conversion: what machines
    without them run, and the CI machine otherwise never builds) de-quantizes every weight to gguf's value and
    multiplies within float32's reordering bound, as the native build does."""
    portable = tuple(f for f in packed_kernel.FLAGS if not f.startswith("-march")) + ("-march=x86-64-v2",)
    builds = (packed_kernel.library(), packed_kernel.library(portable))
    for type_name in ("Q4_1", "Q4_0", "Q8_0", "Q4_K"):
        weight = pack_gguf(_blocks(type_name, seed=6), type_name, ROWS, COLS)
        dequantized = []
        for lib in builds:
            monkeypatch.setattr(packed_kernel, "library", lambda lib=lib: lib)
            dense = weight.dequantize_rows()
            dequantized.append(dense)
            for m in (1, 3, packed_kernel.MAX_ROWS):
                x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(m))
                # float32 sums in another order than the double ones: bounded by the sum of the products' sizes
                expected, bound = x.double() @ dense.double().T, x.abs().double() @ dense.abs().double().T
                assert ((weight.matmul(x).double() - expected).abs() <= 1e-5 * bound + 1e-30).all()
        assert torch.equal(dequantized[0], dequantized[1]), "every weight gguf's value in both builds"
