"""From rollouts to the update's input: TrainItems packed back to back into one row, cut into micro-batches by a
token budget.

The shared-prompt row (train.shared_prompt): the completions of one group follow one copy of their prompt, each
attending to that prompt and to itself (PackedBatch.attention_mask), so a group of G costs one prompt and G
completions where the packed row held G copies of the prompt. The prompt's last position predicts every
completion's first token (target_rows repeats it), and each completion's positions continue from the prompt's
length: every hidden state equals the one of the packed row, and so do the loss and its gradients."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..data.rollouts import Rollout


@dataclass
class TrainItem:
    """A rollout ready for the update: its prompt's token ids, its advantage and its group."""

    rollout: Rollout
    prompt_ids: list[int]
    advantage: float
    group: int
    old_logprobs: torch.Tensor | None = None  # [L]: the step's starting policy's log-probs (epochs x mini_batches > 1)
    capability: float = 1.0  # hacpo: its sender's capability over the learner's (capability.py); 1 for the others

    @property
    def num_input_tokens(self) -> int:
        return len(self.prompt_ids) + self.rollout.num_tokens - 1


@dataclass
class PackedBatch:
    """Sequences packed back to back without padding into one row.

    input_ids / position_ids: [T] (positions restart at 0 for each sequence); target_rows: [N] indices into T of
    the positions that predict each completion token; targets, gen_logprobs: [N]; advantages, group_ids: [S];
    cu_seqlens: [S+1] int32 over the N completion tokens; gen_seq_logprobs: [S] when a sequence came from a peer
    with another tokenizer (its sequence generation log-prob; NaN for the others), else None, and with it
    gen_seq_tokens (the sender's token count behind it) and gen_seq_eos_logprobs (its final EOS's log-prob when it
    stopped); old_logprobs: [N] the step's starting policy's log-probs (several optimizer steps per batch), else
    None; members, stopped: [S] who generated each sequence, and whether it stopped at an EOS (its last token).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_rows: torch.Tensor
    targets: torch.Tensor
    gen_logprobs: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    gen_seq_logprobs: torch.Tensor | None = None  # [S]: NaN, or a foreign sequence's generation log-prob (None: none)
    old_logprobs: torch.Tensor | None = None  # [N]: the step's starting policy's, when every item has them
    segments: torch.Tensor | None = None  # [T]: shared-prompt rows: the segment of each row (a prompt or a completion)
    homes: torch.Tensor | None = None  # [T]: the prompt segment each row also attends to (its own for a prompt)
    gen_seq_tokens: torch.Tensor | None = None  # [S] int32 with gen_seq_logprobs: the sender's tokens (0: not foreign)
    gen_seq_eos_logprobs: torch.Tensor | None = None  # [S] with gen_seq_logprobs: its final EOS's (NaN: none)
    members: torch.Tensor | None = None  # [S] int64: the member that generated each sequence (pack sets it)
    stopped: torch.Tensor | None = None  # [S] bool: its generator stopped it at an EOS, its last token (pack sets it)
    capability_ratio: torch.Tensor | None = None  # [S] float32: hacpo's c of each sequence's sender (pack sets it)

    @property
    def shares_prompts(self) -> bool:
        return self.segments is not None

    def attention_mask(self, kind: str = "bool", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, T, T] what each row (query) attends to: the rows before it, itself included, of its own segment
        and of its prompt's. kind "bool" (True: attend; sdpa), or "additive" (0 or dtype's lowest; eager)."""
        if self.segments is None:
            raise ValueError("attention_mask: a packed row without shared prompts attends by its position_ids")
        seg, home = self.segments, self.homes
        rows = torch.arange(seg.numel(), device=seg.device)
        allowed = (rows[None, :] <= rows[:, None]) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == home[:, None]))
        if kind == "bool":
            return allowed[None, None]
        if kind == "additive":
            low = torch.finfo(dtype).min
            return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(~allowed, low)[None, None]
        raise ValueError(f"attention_mask: unknown kind {kind!r} (bool or additive)")

    @property
    def num_sequences(self) -> int:
        return int(self.advantages.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())


def pack(items: list[TrainItem], shared_prompt: bool = False) -> PackedBatch:
    """Pack items into one row: each contributes prompt + completion[:-1] as input, and its completion tokens
    as targets, predicted from the positions len(prompt)-1 ... end of its segment. shared_prompt=True: consecutive
    items of one group with the same prompt share one copy of it (the module's docstring); the sequences, their
    order and every [N] and [S] tensor stay those of the packed row."""
    inputs, positions, rows, targets, logprobs, lengths = [], [], [], [], [], [0]
    segments, homes = [], []
    offset = 0
    prompt_end = -1  # the row of the current shared prompt's last token
    home = -1
    for k, item in enumerate(items):
        completion = item.rollout.completion_ids.long()
        prompt = torch.tensor(item.prompt_ids, dtype=torch.long)
        if shared_prompt and not shares_previous_prompt(items, k):  # a new prompt: its own segment
            home = len(segments)
            inputs.append(prompt)
            positions.append(torch.arange(prompt.numel()))
            segments.append(torch.full((prompt.numel(),), home))
            homes.append(torch.full((prompt.numel(),), home))
            offset += prompt.numel()
            prompt_end = offset - 1
        if shared_prompt:
            body = completion[:-1]
            own = len(segments)
            inputs.append(body)
            positions.append(torch.arange(prompt.numel(), prompt.numel() + body.numel()))
            segments.append(torch.full((body.numel(),), own))
            homes.append(torch.full((body.numel(),), home))
            rows.append(torch.cat([torch.tensor([prompt_end]), torch.arange(offset, offset + body.numel())]))
            offset += body.numel()
        else:
            segment = torch.cat([prompt, completion[:-1]])
            inputs.append(segment)
            positions.append(torch.arange(segment.numel()))
            first = offset + len(item.prompt_ids) - 1
            rows.append(torch.arange(first, first + completion.numel()))
            offset += segment.numel()
        targets.append(completion)
        logprobs.append(item.rollout.gen_logprobs.float())
        lengths.append(completion.numel())
    foreign = any(it.rollout.seq_logprob is not None for it in items)
    return PackedBatch(
        input_ids=torch.cat(inputs), position_ids=torch.cat(positions), target_rows=torch.cat(rows),
        targets=torch.cat(targets), gen_logprobs=torch.cat(logprobs),
        advantages=torch.tensor([it.advantage for it in items], dtype=torch.float32),
        group_ids=torch.tensor([it.group for it in items], dtype=torch.long),
        cu_seqlens=torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32),
        gen_seq_logprobs=torch.tensor([float("nan") if it.rollout.seq_logprob is None else it.rollout.seq_logprob
                                       for it in items], dtype=torch.float32)
        if any(it.rollout.seq_logprob is not None for it in items) else None,
        old_logprobs=torch.cat([it.old_logprobs.float() for it in items])
        if all(it.old_logprobs is not None for it in items) else None,
        segments=torch.cat(segments) if shared_prompt else None,
        homes=torch.cat(homes) if shared_prompt else None,
        gen_seq_tokens=torch.tensor([it.rollout.seq_tokens or 0 for it in items], dtype=torch.int32) if foreign
        else None,
        gen_seq_eos_logprobs=torch.tensor([float("nan") if it.rollout.seq_eos_logprob is None
                                           else it.rollout.seq_eos_logprob for it in items], dtype=torch.float32)
        if foreign else None,
        members=torch.tensor([it.rollout.member for it in items], dtype=torch.long),
        stopped=torch.tensor([it.rollout.finish_reason == "stop" for it in items]),
        capability_ratio=torch.tensor([it.capability for it in items], dtype=torch.float32),
    )


def without_final_eos(batch: PackedBatch, ignore_index: int) -> PackedBatch:
    """HACPO's view of a packed batch, as its authors prepare every response before its loss (zzx-peter/HACRL-code,
    recipe/hacpo/hacpo_trajectory.py, materialize_rollout_records: a final EOS is popped, an EOS-only response
    keeps it, and the source's log-prob sum and token count are over what is left): the last token of a stopped
    sequence of more than one token counts nowhere (its target ignore_index), and a foreign sequence's generation
    log-prob and token count leave out its sender's final EOS alike."""
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    targets = batch.targets.clone()
    targets[(batch.cu_seqlens[1:] - 1).long()[batch.stopped & (lengths > 1)]] = ignore_index
    if batch.gen_seq_logprobs is None:
        return dataclasses.replace(batch, targets=targets)
    sender = ~torch.isnan(batch.gen_seq_logprobs) & batch.stopped & (batch.gen_seq_tokens > 1)
    eos = torch.nan_to_num(batch.gen_seq_eos_logprobs, nan=0.0)
    return dataclasses.replace(batch, targets=targets,
                               gen_seq_logprobs=torch.where(sender, (batch.gen_seq_logprobs - eos).clamp(max=0.0),
                                                            batch.gen_seq_logprobs),
                               gen_seq_tokens=torch.where(sender, batch.gen_seq_tokens - 1, batch.gen_seq_tokens))


def shares_previous_prompt(items: list[TrainItem], k: int) -> bool:
    """Item k follows an item of its group with the same prompt: in a shared-prompt row it adds no copy of it."""
    return k > 0 and items[k].group == items[k - 1].group and items[k].prompt_ids == items[k - 1].prompt_ids


def input_tokens(items: list[TrainItem], shared_prompt: bool = False) -> int:
    """The row's length pack(items, shared_prompt) gives."""
    total = sum(it.num_input_tokens for it in items)
    if shared_prompt:  # every item after the first of a run of one group and prompt drops its prompt's copy
        total -= sum(len(it.prompt_ids) for k, it in enumerate(items) if shares_previous_prompt(items, k))
    return total


def mini_batches(items: list[TrainItem], parts: int) -> list[list[TrainItem]]:
    """The step's batch cut into at most `parts` mini-batches of whole groups (one optimizer step each), in group
    order, each about the same number of sequences; empty ones are left out."""
    groups: dict[int, list[TrainItem]] = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    ordered = [groups[g] for g in sorted(groups)]
    total = sum(len(g) for g in ordered)
    out: list[list[TrainItem]] = [[]]
    for group in ordered:  # close a part once it holds its share of the sequences
        if out[-1] and len(out) < parts and sum(map(len, out)) + len(group) / 2 > total * len(out) / parts:
            out.append([])
        out[-1].extend(group)
    return [part for part in out if part]


def micro_batches(items: list[TrainItem], token_budget: int, keep_groups: bool = False,
                  shared_prompt: bool = False) -> list[list[TrainItem]]:
    """Split items into consecutive micro-batches of at most `token_budget` input tokens (a sequence longer than
    the budget gets a micro-batch of its own). keep_groups=True never splits a group (items sorted by group).
    shared_prompt=True: a group's prompt is counted once (pack's shared-prompt row), and a group is split only
    where it alone exceeds the budget, in parts that each hold one copy of the prompt."""
    if keep_groups or shared_prompt:
        items = sorted(items, key=lambda it: it.group)
        units: list[list[TrainItem]] = []
        for item in items:
            if units and units[-1][0].group == item.group:
                units[-1].append(item)
            else:
                units.append([item])
        if shared_prompt and not keep_groups:  # a group over the budget: cut into parts that fit
            units = [part for unit in units for part in _fit(unit, token_budget)]
    else:
        units = [[item] for item in items]
    batches: list[list[TrainItem]] = []
    used = 0
    for unit in units:
        size = input_tokens(unit, shared_prompt)
        if batches and used + size <= token_budget:
            batches[-1].extend(unit)
            used += size
        else:
            batches.append(list(unit))
            used = size
    return batches


def _fit(unit: list[TrainItem], token_budget: int) -> list[list[TrainItem]]:
    """One group's items in consecutive parts of at most token_budget shared-prompt tokens (one item at least)."""
    parts: list[list[TrainItem]] = [[]]
    for item in unit:
        if parts[-1] and input_tokens(parts[-1] + [item], True) > token_budget:
            parts.append([])
        parts[-1].append(item)
    return parts


def shard_items(items: list[TrainItem], index: int, size: int) -> list[TrainItem]:
    """Shard `index` of `size`'s part of a member's batch: whole groups (GEPO's group term and horizontal groups
    stay on one rank), dealt to the rank with the fewest tokens so far, largest first. Every shard computes the
    same split from the same items."""
    groups: dict[int, list[TrainItem]] = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    load = [0] * size
    mine: list[TrainItem] = []
    for group in sorted(groups.values(), key=lambda g: (-sum(it.num_input_tokens for it in g), g[0].group)):
        rank = min(range(size), key=lambda r: (load[r], r))
        load[rank] += sum(it.num_input_tokens for it in group)
        if rank == index:
            mine += group
    return mine
