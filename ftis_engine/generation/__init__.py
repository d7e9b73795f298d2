"""Generators: prompts in, completions with per-token generation log-probs out; `sync(model)` after each update.

Both generators (hf.py, vllm.py) return, for every prompt, n `Completion`s whose log-probs are the sampler's own
log-probs of the sampled tokens after temperature (and top-p / top-k, which bias importance ratios and are warned
about). A generator manages its own memory: `with generator.awake():` around generation and eval (a colocated
vLLM engine sleeps outside it, so the update has the GPU), and `close()` at the end of a run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch


class EngineError(RuntimeError):
    """A generator's engine could not take the trainer's weights: it may hold a mix of old and new ones, so the member
    stops (one line, exit code 1); its newest complete checkpoint is intact."""


@dataclass
class Completion:
    token_ids: torch.Tensor  # int32 [L], up to and including EOS when it stopped there
    logprobs: torch.Tensor  # float32 [L]
    finish_reason: str  # "stop" (EOS) | "length" (max_new_tokens)


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    min_new_tokens: int = 0  # no end of sequence before this many tokens (the `long` adversary)


class Generator(Protocol):
    """What the step loop needs from a member's sampler."""

    push_seconds: float  # seconds spent loading the trainer's weights into an engine, every sync so far (0 for
    # a generator that samples from the trainer's own parameters)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                 on_batch: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """sampling.n completions of each prompt (token ids), each with the sampler's log-probs."""

    def greedy(self, prompts: list[list[int]], max_new_tokens: int,
               on_batch: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """One greedy completion (int32 token ids, cut after EOS) of each prompt, for evaluation."""

    def sync(self, model: torch.nn.Module) -> None:
        """The trainer's weights changed: generate from them from now on."""

    def awake(self) -> AbstractContextManager[None]:
        """Hold the generator's memory (engine weights, KV cache) for the duration of the block."""

    def close(self) -> None:
        """Release what the generator holds beyond the run (engines, temporary files)."""


_warned_biased = False


def warn_if_biased(top_p: float, top_k: int | None, vocab_size: int | None = None) -> None:
    """Warn once: with top_p < 1 or a top_k below the vocabulary's size the sampler renormalises over a truncated
    vocabulary, so its log-probs are not log_softmax(logits / T) and the importance ratios computed by the trainer
    are biased (a top_k that covers the whole vocabulary truncates nothing)."""
    global _warned_biased
    truncating_k = top_k is not None and (vocab_size is None or top_k < vocab_size)
    if (top_p < 1.0 or truncating_k) and not _warned_biased:
        _warned_biased = True
        warnings.warn(
            f"rollout.top_p={top_p}, rollout.top_k={top_k}: generation log-probs are renormalised over a truncated "
            "vocabulary, so importance weights against the trainer's full-vocabulary log-probs are biased; "
            "use top_p=1 and no top_k for unbiased ratios",
            stacklevel=2,
        )


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a completion: the model's generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (generation_eos, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return ids


def cut_at_eos(token_ids: torch.Tensor, logprobs: torch.Tensor, eos_ids: set[int], limit: int) -> Completion:
    """The completion up to and including its first EOS token ("stop"), else its first `limit` tokens ("length")."""
    ids = token_ids.tolist()
    for i, token in enumerate(ids[:limit]):
        if token in eos_ids:
            return Completion(token_ids[: i + 1].to(torch.int32), logprobs[: i + 1].float(), "stop")
    return Completion(token_ids[:limit].to(torch.int32), logprobs[:limit].float(), "length")
