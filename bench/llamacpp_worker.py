"""llama.cpp's arm of bench/serve_cpu.py --side-by-side, run by the python of a separate venv that holds
llama-cpp-python (never a dependency of deltaserve, never in CI). Measured with 0.3.36, built from the PyPI sdist
(about 10 min on 2 cores) without AMX:

    python3 -m venv /work/llamacpp-venv-noamx
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF" \
      nice -n 19 /work/llamacpp-venv-noamx/bin/pip install llama-cpp-python==0.3.36

The default build (GGML_NATIVE=ON) compiles ggml's AMX matmul on an AMX CPU, and GCC 12 miscompiles it: its
`_tile_loadconfig` tells the compiler the asm reads 8 bytes, so the stores of the tile shapes are dropped and
`ldtilecfg` loads garbage (a general protection fault, SIGSEGV, on the first llama_decode). GCC 13 or AMX off
avoids it.

Reads one JSON object a line on stdin, {"prompt": [token ids], "concurrency": c, "max_tokens": n}, and answers
one line {"tokens": ..., "seconds": ...}: the c copies of the prompt decoded greedily together as c sequences
of one batch (llama.cpp's server does the same with c parallel slots), timed from the first prefill call to the
last token. Prints {"ready": true, "version": ...} once the model is loaded.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np


def main() -> None:
    path, threads, max_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 2048, 512, max_seqs
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    batch = llama_cpp.llama_batch_init(2048, 0, max_seqs)
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) per batch entry."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits

    def argmax(index: int) -> int:
        row = llama_cpp.llama_get_logits_ith(ctx, index)
        return int(
            np.argmax(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (n_vocab,)))
        )

    for line in sys.stdin:
        request = json.loads(line)
        prompt, count, max_tokens = request["prompt"], request["concurrency"], request["max_tokens"]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        began = time.perf_counter()
        last: list[int] = []
        for seq in range(count):  # each sequence's prompt, its last position's logits kept
            fill([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            if llama_cpp.llama_decode(ctx, batch):
                raise RuntimeError("llama_decode failed on the prompt")
            last.append(argmax(len(prompt) - 1))
        produced = count
        for step in range(1, max_tokens):
            fill([(last[seq], len(prompt) + step - 1, seq, True) for seq in range(count)])
            if llama_cpp.llama_decode(ctx, batch):
                raise RuntimeError("llama_decode failed on a decode step")
            last = [argmax(seq) for seq in range(count)]
            produced += count
        print(json.dumps({"tokens": produced, "seconds": time.perf_counter() - began}), flush=True)


if __name__ == "__main__":
    main()
