"""A step's prefill chunks: packed into one batch (batch), replayed from a captured graph or run eager (graphs)."""
