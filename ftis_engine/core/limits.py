"""The engine's bounds that the config checks and the runtime share, as plain numbers and arithmetic (no torch):
a reward's largest magnitude, and the sizes of the rollouts' wire format (data/rollouts.py holds the format)."""

from __future__ import annotations

HEADER_WORDS = 8  # int32 words of one sequence's header on the wire
HEADER_BYTES = 4 * HEADER_WORDS

# The largest magnitude of a reward (a function's value, and data.rewards' weighted sum) and of a data.rewards
# weight. GRPO's group advantages do not depend on the rewards' scale ((r - mean) / std), so no reward needs more;
# rewards travel as float32 (rollouts.py), and far beyond this a group's spread overflows (a weight of 1e300 made
# the advantages inf).
MAX_REWARD = 1e6


def wire_bytes(num_sequences: int, num_tokens: int) -> int:
    return 4 + HEADER_BYTES * num_sequences + 8 * num_tokens


def max_buffer_words(num_sequences: int, max_new_tokens: int) -> int:
    """The largest honest buffer for `num_sequences` completions: what a receiver is willing to allocate."""
    return 1 + HEADER_WORDS * num_sequences + 2 * num_sequences * max_new_tokens
