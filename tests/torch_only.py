"""transformers' Qwen3.5 modeling with its torch gated delta rule, wherever fla-core is installed."""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType


@functools.cache
def qwen3_5_modeling() -> ModuleType:
    """A private copy of transformers' modeling_qwen3_5, loaded while `import fla` fails. Where fla-core is
    installed, transformers' own module routes its gated delta rule to fla's Triton kernels (which a
    CUDA machine's transformers does for CPU tensors too, and they refuse them); the reference these tests
    compare against is the torch one, the same on every machine."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    name = "transformers.models.qwen3_5._modeling_qwen3_5_torch_only"
    spec = importlib.util.spec_from_file_location(name, modeling_qwen3_5.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # transformers' docstring decorators look their classes' source file up by it
    hidden = {
        key: sys.modules.pop(key) for key in list(sys.modules) if key == "fla" or key.startswith("fla.")
    }
    sys.modules["fla"] = None  # type: ignore[assignment]  # None in sys.modules: `import fla` raises
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
    return module
