"""The context budget: how many tokens a member's prompts and completions may take, decided here and nowhere else.

A prompt is measured with every member's tokenizer (and chat template), the longest counting: every member must
fit it. `data.max_prompt_tokens` bounds the prompts a run uses (training prompts beyond it are left out, eval
prompts too); a completion of up to `max_new_tokens` (rollout's and eval's) after the longest prompt must fit each
member's context (`models.model_context`); a vLLM engine is sized for the longest prompt the limit allows plus
the longest completion; and a peer's completion that re-encodes into a member's tokens may take at most what fits
after the longest prompt, and at most FOREIGN_EXPANSION x max_new_tokens.
"""

from __future__ import annotations

import logging

from ..config import ConfigError, MemberSettings, RunConfig
from .tasks import prompt_ids

log = logging.getLogger("ftis_engine")

# a foreign completion may re-encode into at most this many times max_new_tokens here (a character tokenizer
# spells out a merge of up to a dozen characters; tokenizers of real model families differ by far less)
FOREIGN_EXPANSION = 16


def longest_completion(config: RunConfig) -> int:
    """The most new tokens a member generates: rollout.max_new_tokens, or eval's when that is longer."""
    return max(config.rollout.max_new_tokens, config.eval.max_new_tokens or 0)


def engine_length(config: RunConfig, settings: MemberSettings) -> int:
    """A vLLM engine's max_model_len: members.N.vllm.max_model_len, else the longest prompt data.max_prompt_tokens
    allows plus the longest completion."""
    return settings.vllm.max_model_len or config.data.max_prompt_tokens + longest_completion(config)


def check_context(config: RunConfig, index: int, context: int | None, longest_prompt: int = 0) -> None:
    """A completion of up to max_new_tokens (rollout's, and eval's) after the longest prompt the run uses must fit
    the member's context, or generation runs past what the model was built for (or without end). Before the data
    is read (longest_prompt 0) only a completion that cannot fit after any prompt is refused."""
    if context is None:
        return
    for field, new in (("rollout.max_new_tokens", config.rollout.max_new_tokens),
                       ("eval.max_new_tokens", config.eval.max_new_tokens)):
        if new is not None and longest_prompt + new >= context + (1 if longest_prompt else 0):
            after = (f" after the longest prompt of {longest_prompt} tokens (data.max_prompt_tokens="
                     f"{config.data.max_prompt_tokens} bounds them)" if longest_prompt else "")
            raise ConfigError(f"{field}: {new} new tokens{after} exceed members.{index}.model's context of "
                              f"{context} tokens; lower it")


def foreign_limit(config: RunConfig, context: int | None, longest_prompt: int) -> int:
    """The most tokens a foreign peer's completion may re-encode into for a member of this context: what fits
    after the longest prompt, and at most FOREIGN_EXPANSION x max_new_tokens (exchange/verify.py, adopt)."""
    limit = FOREIGN_EXPANSION * config.rollout.max_new_tokens
    return min(limit, context - longest_prompt) if context else limit


def prompt_tokens(tokenizers: list, task, question: str) -> int:
    """A prompt's length under the tokenizer that makes it longest: every member must fit it (its context, its
    vLLM max_model_len, data.max_prompt_tokens)."""
    return max(len(prompt_ids(tokenizer, task, question)) for tokenizer in tokenizers)


def usable_prompts(config: RunConfig, task, tokenizers: list, collectives) -> tuple[list[int], int]:
    """Training prompts that fit data.max_prompt_tokens with every tokenizer (rank 0's list on every rank, through
    `collectives`), and the longest prompt the run uses, in tokens; eval sets (task.evals) are cut alike."""
    limit = config.data.max_prompt_tokens
    lengths = [prompt_tokens(tokenizers, task, ex.question) for ex in task.train]
    fits = [i for i, n in enumerate(lengths) if n <= limit]
    fits = collectives.all_gather_object(fits)[0]
    if task.train and len(fits) < config.rollout.prompts_per_step:  # (an eval reads no training set)
        if len(task.train) < config.rollout.prompts_per_step:  # the data set itself is too small
            raise ConfigError(f"rollout.prompts_per_step={config.rollout.prompts_per_step}: the task's training set "
                              f"has only {len(task.train)} prompts")
        raise ConfigError(f"data.max_prompt_tokens={limit}: only {len(fits)} training prompts are that "
                          f"short, fewer than rollout.prompts_per_step={config.rollout.prompts_per_step}")
    longest = max((lengths[i] for i in fits if i < len(lengths)), default=0)
    for name, examples in task.evals.items():  # eval prompts obey the same limit (a vLLM engine is sized by it)
        eval_lengths = [prompt_tokens(tokenizers, task, ex.question) for ex in examples]
        keep = [i for i, n in enumerate(eval_lengths) if n <= limit]
        kept = [examples[i] for i in collectives.all_gather_object(keep)[0]]
        if len(kept) < len(examples):
            log.warning("eval %s: %d of %d prompts exceed data.max_prompt_tokens=%d and are left out", name,
                        len(examples) - len(kept), len(examples), limit)
        task.evals[name] = kept
        longest = max([longest] + [eval_lengths[i] for i in keep])
    return fits, longest
