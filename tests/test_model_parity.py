"""Our Llama over a paged KV pool generates the same greedy tokens as Hugging Face on the same GGUF."""

from __future__ import annotations

import math
import random
import threading
from concurrent.futures import CancelledError

import gguf
import numpy as np
import pytest
import torch

from executor_svc.kv_pool import KVPool
from executor_svc.models import loader
from executor_svc.models.dense import DenseModel
from executor_svc.models.loader import load_fingerprinted, load_model, model_fingerprint
from protos.model_files import default_model_path
from tests.conftest import decode_logits, prefill_logits
from tests.hf_reference import EOS_TOKEN_ID, chat_ids, chat_prompts, hf_greedy

NEW_TOKENS = 24
PAGE_SIZE = 16
# Not a multiple of the page size, so chunks end mid-page and the next chunk continues that page.
PREFILL_CHUNK = 300
BATCH = 16


def _prefill(model: DenseModel, kv: KVPool, prompt: list[int], pages: torch.Tensor) -> int:
    """Prefill in chunks; returns the first generated token."""
    ids = torch.tensor(prompt)
    for start in range(0, len(prompt), PREFILL_CHUNK):
        logits = prefill_logits(model, kv, ids[start : start + PREFILL_CHUNK], start, pages)
    return int(logits.argmax())


@pytest.fixture(scope="module")
def model() -> DenseModel:
    return load_model(default_model_path(), "cpu", torch.float32)


@pytest.fixture(scope="module")
def cases() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, Hugging Face's greedy continuation) per chat prompt."""
    prompts = [chat_ids(messages) for messages in chat_prompts()]
    return [(prompt, hf_greedy(prompt, NEW_TOKENS)) for prompt in prompts]


@pytest.fixture(scope="module")
def prefilled(model, cases):
    """All prompts prefilled into one small pool, each on shuffled (non-contiguous) pages.

    Returns (pool, a copy of its K/V right after prefill, each prompt's pages, each first token).
    """
    needs = [math.ceil((len(prompt) + NEW_TOKENS) / PAGE_SIZE) for prompt, _ in cases]
    kv = model.make_kv_pool(num_pages=1 + sum(needs) + 7, page_size=PAGE_SIZE)
    free = list(range(1, kv.num_pages))  # page 0 is the sink
    random.Random(0).shuffle(free)
    pages = []
    for need in needs:
        pages.append(torch.tensor(free[:need], dtype=torch.int32))
        del free[:need]
    first_tokens = [_prefill(model, kv, prompt, p) for (prompt, _), p in zip(cases, pages, strict=True)]
    return kv, (kv.k.clone(), kv.v.clone()), pages, first_tokens


def _restore(kv: KVPool, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
    # Decode writes past each prompt; restoring keeps one test's writes from hiding another's misplaced ones.
    kv.k.copy_(snapshot[0])
    kv.v.copy_(snapshot[1])


def test_prompts_cover_short_and_long(cases):
    lengths = [len(prompt) for prompt, _ in cases]
    assert len(lengths) == 8
    assert all(n > 1000 for n in lengths[5:]) and all(n < 100 for n in lengths[:5])
    assert min(lengths[5:]) > 3 * PREFILL_CHUNK, "each long prompt takes several prefill chunks"


def test_single_row_decode_matches_hf(model, cases, prefilled):
    kv, snapshot, pages, first_tokens = prefilled
    _restore(kv, snapshot)
    for (prompt, expected), row_pages, token in zip(cases, pages, first_tokens, strict=True):
        block_table = row_pages[None, :]
        generated = [token]
        while token != EOS_TOKEN_ID and len(generated) < NEW_TOKENS:
            kv_len = len(prompt) + len(generated) - 1  # the last token's K/V is not stored yet
            logits = decode_logits(
                model,
                kv,
                torch.tensor([token]),
                torch.tensor([kv_len]),
                torch.tensor([kv_len], dtype=torch.int32),
                block_table,
            )
            token = int(logits[0].argmax())
            generated.append(token)
        assert generated == expected, f"prompt of {len(prompt)} tokens diverged"


def test_batched_decode_with_padding_matches_hf(model, cases, prefilled):
    kv, snapshot, pages, first_tokens = prefilled
    _restore(kv, snapshot)
    # Real rows scattered among padding rows, so a padding row sits before, between and after them.
    real_rows = [1, 2, 4, 7, 8, 11, 13, 14]
    width = max(len(p) for p in pages) + 3
    block_tables = torch.zeros(BATCH, width, dtype=torch.int32)
    for row, row_pages in zip(real_rows, pages, strict=True):
        block_tables[row, : len(row_pages)] = row_pages
    generated = [[token] for token in first_tokens]
    active = [token != EOS_TOKEN_ID for token in first_tokens]
    while any(active):
        tokens = torch.zeros(BATCH, dtype=torch.long)
        kv_lens = torch.zeros(BATCH, dtype=torch.int32)
        tables = torch.zeros_like(block_tables)  # finished rows become padding: sink page, length 0
        for i, row in enumerate(real_rows):
            if active[i]:
                tokens[row] = generated[i][-1]
                kv_lens[row] = len(cases[i][0]) + len(generated[i]) - 1
                tables[row] = block_tables[row]
        logits = decode_logits(model, kv, tokens, kv_lens.long(), kv_lens, tables)
        assert not logits.isnan().any(), "padding rows must not produce NaN"
        for i, row in enumerate(real_rows):
            if active[i]:
                generated[i].append(int(logits[row].argmax()))
                active[i] = generated[i][-1] != EOS_TOKEN_ID and len(generated[i]) < NEW_TOKENS
    for (prompt, expected), got in zip(cases, generated, strict=True):
        assert got == expected, f"prompt of {len(prompt)} tokens diverged when batched"


def test_chunked_prefill_equals_one_shot(model, cases):
    prompt = cases[6][0]
    kv = model.make_kv_pool(num_pages=2 + len(prompt) // PAGE_SIZE, page_size=PAGE_SIZE)
    pages = torch.arange(kv.num_pages - 1, 0, -1, dtype=torch.int32)  # reversed: far from contiguous
    ids = torch.tensor(prompt)
    one_shot = prefill_logits(model, kv, ids, 0, pages)
    for start in range(0, len(prompt), PREFILL_CHUNK):
        chunked = prefill_logits(model, kv, ids[start : start + PREFILL_CHUNK], start, pages)
    torch.testing.assert_close(chunked, one_shot, atol=2e-4, rtol=1e-4)


def test_fingerprint_is_stable_and_cheap():
    path = default_model_path()
    assert model_fingerprint(path) == model_fingerprint(path)
    assert len(model_fingerprint(path)) == 64


def small_llama_config(**fields):
    """A small random Llama's transformers config: GQA 2:1, 2 layers."""
    from transformers import LlamaConfig

    shape = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaConfig(**shape, **fields)


def test_safetensors_directory_matches_hf(tmp_path):
    """A small random Llama saved by transformers (untied head, GQA) loads and decodes as HF generates."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = small_llama_config(
        tie_word_embeddings=False,
        eos_token_id=319,
        bos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    hf = LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    assert ours.lm_head is not None and ours.config.num_kv_heads == 2 and ours.config.rope_theta == 500.0
    assert_greedy_as_hf(hf, ours)


def assert_greedy_as_hf(hf: torch.nn.Module, ours: DenseModel) -> None:
    """12 greedy tokens of a prompt read in two chunks, then decoded one by one, equal to HF's generate."""
    prompt = [5, 17, 42, 99, 3, 250, 8, 61, 14, 77, 200]
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    expected = out[0, len(prompt) :].tolist()

    kv = ours.make_kv_pool(num_pages=12, page_size=4)
    pages = torch.tensor([9, 2, 7, 4, 11, 1, 5], dtype=torch.int32)
    ids = torch.tensor(prompt)
    prefill_logits(ours, kv, ids[:6], 0, pages)
    generated = [int(prefill_logits(ours, kv, ids[6:], 6, pages).argmax())]
    while len(generated) < len(expected):
        kv_len = len(prompt) + len(generated) - 1
        logits = decode_logits(
            ours,
            kv,
            torch.tensor([generated[-1]]),
            torch.tensor([kv_len]),
            torch.tensor([kv_len], dtype=torch.int32),
            pages[None, :],
        )
        generated.append(int(logits[0].argmax()))
    assert generated == expected


@pytest.mark.parametrize("stored", ["a head unlike the embedding", "the head alone"])
def test_a_tied_config_with_a_stored_head_serves_what_transformers_does(tmp_path, stored: str):
    """transformers ties only what is equal: a stored head unlike the embedding (a fine-tune that trained it
    untied under a tied config) is served untied, and a head stored alone is the embedding too."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = small_llama_config(tie_word_embeddings=True)
    tensors = {name: t.contiguous() for name, t in LlamaForCausalLM(hf_config).state_dict().items()}
    if stored == "the head alone":
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    hf_config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(str(tmp_path), "cpu", torch.float32)
    assert ours.config.tie_embeddings == (stored == "the head alone")
    assert_greedy_as_hf(hf, ours)


def test_the_fingerprint_covers_every_byte_of_the_weights(tmp_path):
    """A fine-tune differs from its base in weights anywhere in a file: a snapshot's KV must not pass as the
    other's. (The first and last MiB alone, hashed before, were the same here.)"""
    from safetensors.torch import save_file

    base, tuned = tmp_path / "base", tmp_path / "tuned"
    outer = {"a": torch.zeros(1 << 19), "c": torch.ones(1 << 19)}  # 2 MiB each side
    for path, middle in ((base, 0.0), (tuned, 0.5)):
        path.mkdir()
        (path / "config.json").write_text('{"model_type": "llama"}')
        save_file({**outer, "b": torch.full((1024,), middle)}, str(path / "model.safetensors"))
    assert model_fingerprint(str(base)) != model_fingerprint(str(tuned))


def test_the_fingerprint_taken_beside_the_load_is_model_fingerprints(tmp_path, monkeypatch):
    path = str(_tiny_llama_dir(tmp_path / "tiny"))
    model, fingerprint = load_fingerprinted(path, "cpu", torch.float32)
    assert fingerprint == model_fingerprint(path)
    assert model.config.num_layers == load_model(path, "cpu", torch.float32).config.num_layers

    def unreadable(*args):
        raise PermissionError(f"[Errno 13] Permission denied: '{path}/model.safetensors'")

    monkeypatch.setattr(loader, "model_fingerprint", unreadable)  # the hash's error is not lost
    with pytest.raises(PermissionError, match="Permission denied"):
        load_fingerprinted(path, "cpu", torch.float32)


def test_a_failed_load_reports_its_own_error_and_stops_the_fingerprint(tmp_path, monkeypatch):
    path = str(_tiny_llama_dir(tmp_path / "gelu", hidden_act="gelu"))
    stop = threading.Event()
    stop.set()
    with pytest.raises(CancelledError):  # a stopped hash gives up at its next block
        model_fingerprint(path, stop)
    stopped = []

    def long_hash(path, stop):  # one that ends only once stopped
        stopped.append(stop.wait(10))
        raise CancelledError

    monkeypatch.setattr(loader, "model_fingerprint", long_hash)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        load_fingerprinted(path, "cpu", torch.float32)
    assert stopped == [True]  # stopped, and done before the load's error was raised


def test_unsupported_models_are_refused_clearly(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(str(tmp_path), "cpu", torch.float32)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a .gguf file"):
        load_model(str(weights), "cpu", torch.float32)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_model(str(empty), "cpu", torch.float32)


def _tiny_llama_dir(directory, **overrides):
    """A tiny random Llama (tests/tiny_families.py's linear-rope variant) saved with save_pretrained."""
    from transformers import LlamaForCausalLM

    from tests.tiny_families import hf_config

    LlamaForCausalLM(hf_config("linear_biases", **overrides)).save_pretrained(directory)
    return directory


def test_a_checkpoint_a_user_mangled_is_refused_naming_what_is_wrong(tmp_path):
    import json

    from safetensors.torch import save_file

    cases = {}
    bad_json = _tiny_llama_dir(tmp_path / "bad-json")
    (bad_json / "config.json").write_text('{"model_type": ')
    cases["bad-json"] = "config.json is not valid JSON"
    _tiny_llama_dir(tmp_path / "gelu", hidden_act="gelu")
    cases["gelu"] = "hidden_act 'gelu' is not supported"
    no_factor = _tiny_llama_dir(tmp_path / "no-factor")
    config = json.loads((no_factor / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"type": "linear"}  # its factor missing
    (no_factor / "config.json").write_text(json.dumps(config))
    cases["no-factor"] = "config.json is incomplete or malformed"
    truncated = _tiny_llama_dir(tmp_path / "truncated")
    blob = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(blob[: len(blob) // 2])  # an interrupted download
    cases["truncated"] = "model.safetensors cannot be read"
    stale = _tiny_llama_dir(tmp_path / "stale")
    save_file({"model.norm.weight": torch.ones(16)}, str(stale / "old.safetensors"))
    cases["stale"] = "model.norm.weight is in more than one"
    for name, says in cases.items():
        with pytest.raises(ValueError, match=says):
            load_model(str(tmp_path / name), "cpu", torch.float32)
    cut = tmp_path / "cut.gguf"  # an interrupted download of a GGUF: the file named, not numpy's words alone
    writer = gguf.GGUFWriter(str(cut), "llama")
    writer.add_tensor("token_embd.weight", np.ones((101, 144), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut.write_bytes(cut.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{cut}: not a GGUF this can read .*cut short"):
        load_model(str(cut), "cpu", torch.float32)
    from protos.model_files import load_tokenizer

    with pytest.raises(ValueError, match="cannot load its tokenizer"):  # the planner's: no tokenizer files
        load_tokenizer(str(stale))


def test_stop_ids_come_from_generation_config_for_every_family(tmp_path):
    """transformers' generate stops on generation_config.json's eos ids: so does every family (the hybrid
    read config.json's only), and a null there keeps config.json's."""
    import json

    from executor_svc.models import qwen3_5
    from executor_svc.models.dense import dense_config_from_hf
    from tests.hybrid_model import TEXT_CONFIG

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 427]}))
    hybrid = qwen3_5.read_hf_config({**TEXT_CONFIG, "model_type": "qwen3_5_text"}, str(tmp_path))
    assert hybrid.eos_token_ids == (2, 427)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    hybrid = qwen3_5.read_hf_config({**TEXT_CONFIG, "model_type": "qwen3_5_text"}, str(tmp_path))
    assert hybrid.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh' is not supported"):
        qwen3_5.read_hf_config({**TEXT_CONFIG, "hidden_act": "gelu_pytorch_tanh"}, str(tmp_path))
    from transformers import LlamaConfig

    dense = dense_config_from_hf(
        {"eos_token_id": 7, "vocab_size": 64}, str(tmp_path), LlamaConfig, qk_norm=False
    )
    assert dense.eos_token_ids == (7,)
