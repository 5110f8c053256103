"""A reasoning model's thought tags (Qwen3, Qwen3.5, DeepSeek-R1 think in <think>...</think> before they answer):
where the planner finds a chat's answer begins inside a thought, and the gateway splits thought from answer."""

THOUGHT_OPEN, THOUGHT_END = "<think>", "</think>"


def ends_in_thought(text: str) -> bool:
    """Whether `text` leaves a thought open: its last THOUGHT_OPEN comes after its last THOUGHT_END."""
    return text.rfind(THOUGHT_OPEN) > text.rfind(THOUGHT_END)
