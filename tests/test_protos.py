"""The generated protocol code is committed; regenerating it from the .proto files gives no diff."""

from __future__ import annotations

import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ["client", "executor", "cache"]
GENERATED = [f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_regenerating_protos_gives_no_diff(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    (tmp_path / "protos").mkdir()
    for name in PROTOS:
        shutil.copy(ROOT / "protos" / f"{name}.proto", tmp_path / "protos" / f"{name}.proto")
    args = [
        "protoc",
        f"-I{tmp_path}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *(str(tmp_path / "protos" / f"{name}.proto") for name in PROTOS),
    ]
    assert grpc_tools.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), (
            f"protos/{name} is stale: regenerate with python -m grpc_tools.protoc -I. --python_out=. "
            "--pyi_out=. --grpc_python_out=. protos/*.proto"
        )


def test_row_layout_is_derived_from_the_widest_bucket():
    from protos.layout import RowLayout

    layout = RowLayout.build([1, 2, 4, 256], max_seq_len=8192, page_size=16, pool_pages=100)
    assert layout.slots == 513 and layout.block_span == 100 and layout.columns == 103
    assert RowLayout.build([8], 8192, 16, 4096).block_span == 512
