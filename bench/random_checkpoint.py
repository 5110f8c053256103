"""A Hugging Face checkpoint of SmolLM2-135M's shape with random bf16 weights and a real tokenizer, for
benchmarks of whole stacks (`deltaserve up --model DIR`) on machines without the weights.

    python bench/random_checkpoint.py --tokenizer .tok --out /tmp/smollm2-random
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory (save_pretrained)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bench.common import smollm2_config

    shape = smollm2_config()  # SmolLM2-135M's published configuration, as every benchmark fills it
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        # transformers 5 still takes the legacy rope_theta (its dataclass init hands unknown keywords to
        # __post_init__, which moves it into rope_parameters), but its typed signature lists only
        # rope_parameters; rope_theta is also what pyproject's floor, transformers 4.46, knows.
        rope_theta=shape.rope_theta,  # type: ignore[call-arg]
        rms_norm_eps=shape.rms_eps,
        max_position_embeddings=shape.max_seq_len,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=shape.bos_token_id,
        eos_token_id=list(shape.eos_token_ids),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # PreTrainedModel.to is functools.wraps(Module.to), which typeshed types as a callable that does not bind
    # self; called as a Module, it is the same method (PreTrainedModel.to, which casts in place).
    module: torch.nn.Module = model
    module.to(torch.bfloat16)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
