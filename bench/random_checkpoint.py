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

    # SmolLM2-135M's published configuration (config.json of HuggingFaceTB/SmolLM2-135M-Instruct)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
