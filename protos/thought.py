"""A reasoning model's thought tags (Qwen3, Qwen3.5, DeepSeek-R1 think in <think>...</think> before they answer):
where the planner finds a chat's answer begins inside a thought, and the gateway splits thought from answer."""

THOUGHT_OPEN, THOUGHT_END = "<think>", "</think>"


def opens_thought(prompt: str) -> bool:
    """Whether `prompt` ends by opening a thought (a generation prompt's "<think>\\n"; a <think> anywhere before
    its end, a user's message that names the tag, is not one)."""
    return prompt.rstrip().endswith(THOUGHT_OPEN)
