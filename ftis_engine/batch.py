"""From rollouts to the update's input: TrainItems packed back to back into one row, cut into micro-batches by a
token budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rollouts import Rollout


@dataclass
class TrainItem:
    """A rollout ready for the update: its prompt's token ids, its advantage and its group."""

    rollout: Rollout
    prompt_ids: list[int]
    advantage: float
    group: int
    old_logprobs: torch.Tensor | None = None  # [L]: the step's starting policy's log-probs (epochs x mini_batches > 1)

    @property
    def num_input_tokens(self) -> int:
        return len(self.prompt_ids) + self.rollout.num_tokens - 1


@dataclass
class PackedBatch:
    """Sequences packed back to back without padding into one row.

    input_ids / position_ids: [T] (positions restart at 0 for each sequence); target_rows: [N] indices into T of
    the positions that predict each completion token; targets, gen_logprobs: [N]; advantages, group_ids: [S];
    cu_seqlens: [S+1] int32 over the N completion tokens; gen_seq_logprobs: [S] when a sequence came from a peer
    with another tokenizer (its sequence generation log-prob; NaN for the others), else None; old_logprobs: [N] the
    step's starting policy's log-probs (several optimizer steps per batch), else None.
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

    @property
    def num_sequences(self) -> int:
        return int(self.advantages.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())


def pack(items: list[TrainItem]) -> PackedBatch:
    """Pack items into one row: each contributes prompt + completion[:-1] as input, and its completion tokens
    as targets, predicted from the positions len(prompt)-1 ... end of its segment."""
    inputs, positions, rows, targets, logprobs, lengths = [], [], [], [], [], [0]
    offset = 0
    for item in items:
        completion = item.rollout.completion_ids.long()
        segment = torch.cat([torch.tensor(item.prompt_ids, dtype=torch.long), completion[:-1]])
        inputs.append(segment)
        positions.append(torch.arange(segment.numel()))
        first = offset + len(item.prompt_ids) - 1
        rows.append(torch.arange(first, first + completion.numel()))
        targets.append(completion)
        logprobs.append(item.rollout.gen_logprobs.float())
        lengths.append(completion.numel())
        offset += segment.numel()
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
    )


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


def micro_batches(items: list[TrainItem], token_budget: int, keep_groups: bool = False) -> list[list[TrainItem]]:
    """Split items into consecutive micro-batches of at most `token_budget` input tokens (a sequence longer than
    the budget gets a micro-batch of its own). keep_groups=True never splits a group (items sorted by group)."""
    if keep_groups:
        items = sorted(items, key=lambda it: it.group)
        units: list[list[TrainItem]] = []
        for item in items:
            if units and units[-1][0].group == item.group:
                units[-1].append(item)
            else:
                units.append([item])
    else:
        units = [[item] for item in items]
    batches: list[list[TrainItem]] = []
    used = 0
    for unit in units:
        size = sum(it.num_input_tokens for it in unit)
        if batches and used + size <= token_budget:
            batches[-1].extend(unit)
            used += size
        else:
            batches.append(list(unit))
            used = size
    return batches


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
