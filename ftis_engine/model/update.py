"""One F-TIS update of one member: pack, run the model body to hidden states, fused loss on the lm_head, step.

Micro-batches are cut by a token budget; each is given the whole batch's sequence and token counts, so the op
normalises every micro-batch's loss by the whole batch and their gradients add up to the whole batch's: micro-
batching changes memory, never the update (and this file knows none of the normalisation rules; under `reject`,
rejection_scale corrects the normaliser by the counts rejection left, which no micro-batch knows in advance).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch
from ftis_kernels import (
    STAT_KEYS,
    LossConfig,
    LossOutput,
    NonFiniteInputError,
    combine_stats,
    fused_linear_ftis_loss,
    rejection_scale,
)

from .batch import PackedBatch, TrainItem, micro_batches, mini_batches, pack, shard_items, without_final_eos
from .fsdp import Shard, full, local


def body_inputs(member, batch: PackedBatch) -> dict:
    """The decoder body's keyword arguments for one packed row: ids and positions, and for a shared-prompt row the
    [1, 1, T, T] mask in the form the member's attention takes (transformers passes a 4D mask through as it is)."""
    device = member.device
    inputs = dict(input_ids=batch.input_ids[None].to(device), position_ids=batch.position_ids[None].to(device))
    if batch.shares_prompts:
        kind = "additive" if member.causal_lm.config._attn_implementation == "eager" else "bool"
        inputs["attention_mask"] = batch.attention_mask(kind).to(device)
    return inputs


def packed_hidden(member, batch: PackedBatch, body=None) -> torch.Tensor:
    """[N, d] final hidden states at the rows that predict the completion tokens (no logits are formed).
    The sequences are packed in one row with restarting position_ids and no attention mask, which transformers
    turns into per-sequence attention (flash-attn varlen, or a block-diagonal mask for sdpa/eager); a shared-
    prompt row carries its own mask (batch.py)."""
    if body is None:
        body, _ = member.body_and_head()
    with member.autocast():
        out = body(**body_inputs(member, batch), use_cache=False)
    return out.last_hidden_state[0, batch.target_rows.to(member.device)]


def batch_loss(member, batch: PackedBatch, cfg: LossConfig, backend: str, *, num_sequences: int | None = None,
               num_tokens: int | None = None, mini_batch_index: int | None = None) -> LossOutput:
    """LossOutput of one packed micro-batch, normalised by the whole batch's counts when given (default: its own).
    A sharded member runs it through its FSDP2 root (fsdp.ShardedPolicy), which gathers the head for it. The
    head runs in the member's compute dtype: under autocast the op casts its operands as a linear layer would (the
    float32 master weight's cast widens dW on the way back) and computes in float32. hacpo: the member's own
    sequences are its self term (is_self), mini_batch_index the step's optimizer step (its cross term's bound),
    batch.capability_ratio each peer sequence's c (capability.py)."""
    device = member.device
    reference = reference_logprobs(member, batch, cfg) if cfg.beta > 0 else None
    is_self = (batch.members == member.index).to(device) if cfg.method == "hacpo" else None

    def loss(hidden, weight, bias):
        return fused_linear_ftis_loss(
            hidden, weight, batch.targets.to(device), batch.gen_logprobs.to(device), batch.advantages.to(device),
            batch.cu_seqlens.to(device), bias=bias, config=cfg, group_ids=batch.group_ids.to(device),
            backend=backend, num_sequences=num_sequences, num_tokens=num_tokens,
            gen_seq_logprobs=None if batch.gen_seq_logprobs is None else batch.gen_seq_logprobs.to(device),
            old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs.to(device),
            ref_logprobs=reference, is_self=is_self, mini_batch_index=mini_batch_index,
            gen_seq_tokens=None if batch.gen_seq_tokens is None else batch.gen_seq_tokens.to(device),
            capability_ratio=None if is_self is None or batch.capability_ratio is None
            else batch.capability_ratio.to(device),
        )

    if member.policy is not None:
        inputs = body_inputs(member, batch)
        with member.autocast():
            return member.policy(inputs["input_ids"], inputs["position_ids"], batch.target_rows.to(device), loss,
                                 attention_mask=inputs.get("attention_mask"))[1]
    _, head = member.body_and_head()
    with member.autocast():
        return loss(packed_hidden(member, batch), head.weight, head.bias)


@torch.no_grad()
def reference_logprobs(member, batch: PackedBatch, cfg: LossConfig) -> torch.Tensor:
    """[N] log-probs of the batch's targets under the member's reference policy (its initial weights), for the KL
    penalty (algorithm.beta): a LoRA member's base with the adapter disabled, a full member's frozen copy."""
    from ftis_kernels import fused_linear_token_logprobs

    device = member.device
    with member.autocast():
        if member.reference is None:  # LoRA: the base the adapter sits on
            with member.model.disable_adapter():
                hidden = packed_hidden(member, batch)
            head = member.causal_lm.get_output_embeddings()
        else:
            hidden = packed_hidden(member, batch, body=member.reference.get_decoder())
            head = member.reference.get_output_embeddings()
        return fused_linear_token_logprobs(hidden, head.weight, batch.targets.to(device), cfg.temperature,
                                           bias=head.bias)


def accumulate_gradients(member, items: list[TrainItem], cfg: LossConfig, token_budget: int, backend: str,
                         on_micro_batch=None, mini_batch_index: int | None = None) -> dict[str, float]:
    """Forward and backward over all micro-batches (gradients accumulate in .grad); returns the whole-batch loss
    and stats. GEPO's group term needs whole groups, so its micro-batches never split one. hacpo trains on its
    authors' view of each micro-batch (batch.without_final_eos)."""
    whole = dict(num_sequences=len(items), num_tokens=sum(it.rollout.num_tokens for it in items))
    shard = member.shard
    mine = shard_items(items, shard.index, shard.size) if shard.sharded else items
    batches = micro_batches(mine, token_budget, keep_groups=cfg.base_method == "gepo",
                            shared_prompt=member.shared_prompt)
    # a sharded member's ranks run as many micro-batches each (FSDP2 gathers every layer for each): a rank with
    # fewer runs the rest on a stand-in whose loss counts zero. FSDP2 averages the ranks' gradients: x K sums them
    rounds, factor = shard.max(len(batches)), float(shard.size)
    loss, outputs, failed = 0.0, [], None
    own_sum, own_count = 0.0, 0  # the member's own tokens of its newest policy version: exp(l - g)
    newest = max((it.rollout.policy_version for it in items if it.rollout.member == member.index), default=None)
    for k in range(rounds):
        if k >= len(batches) or failed is not None:
            stand_in(member)
            continue
        batch = pack(batches[k], member.shared_prompt)
        if cfg.method == "hacpo":
            batch = without_final_eos(batch, cfg.ignore_index)
        try:
            out = batch_loss(member, batch, cfg, backend, **whole, mini_batch_index=mini_batch_index)
        except NonFiniteInputError as exc:
            if not shard.sharded:
                raise
            failed = exc  # the other shards are in this round's collectives: finish the rounds, then agree
            stand_in(member)
            continue
        (out.loss * factor if factor != 1.0 else out.loss).backward()
        loss += float(out.loss.detach())
        outputs.append(out)  # its graph is freed by backward; the stats it keeps are scalars
        ratios = own_ratios(out.logprobs, batch, batches[k], member.index, newest)
        own_sum, own_count = own_sum + float(ratios.sum()), own_count + ratios.numel()
        if on_micro_batch is not None:
            on_micro_batch(batch.num_tokens)
    if not shard.all_true(failed is None):
        raise NonFiniteInputError(str(failed) if failed is not None else "on another rank of this member")
    if shard.sharded:  # the whole member's loss and stats: every shard's sums and counts
        mine_stats = [LossOutput(loss=torch.zeros(()), logprobs=torch.zeros(0),
                                 stat_sums={k: v.detach().cpu() for k, v in out.stat_sums.items()},
                                 stat_counts={k: v.detach().cpu() for k, v in out.stat_counts.items()})
                      for out in outputs]
        gathered = shard.all_gather((loss, mine_stats, own_sum, own_count))
        loss = sum(part[0] for part in gathered)
        outputs = [out for part in gathered for out in part[1]]
        own_sum, own_count = sum(part[2] for part in gathered), sum(part[3] for part in gathered)
    stats = combine_stats(outputs)
    scale = rejection_scale(cfg, stats, **whole)
    if scale != 1.0:  # rejection left fewer tokens or sequences than the normaliser each micro-batch was given
        loss *= scale
        for p in member.trainable_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    own_ratio = own_sum / own_count if own_count else float("nan")
    return {"loss": loss, **stats, "own_ratio_mean": own_ratio, "micro_batches": len(batches)}


def own_ratios(logprobs: torch.Tensor, batch: PackedBatch, items: list[TrainItem], index: int,
               version: int | None) -> torch.Tensor:
    """exp(l - g) of the micro-batch's own tokens (those of rollouts member `index` made at policy `version`, the
    newest of its own in the batch): the trainer's probability of each own token over its generator's. Near 1 when
    generator and trainer agree (a vLLM engine in sync); peers' tokens, and its samplers' rollouts of older
    versions, are left out, so their mean stays that check in a collaborating or decoupled run, where
    is_weight_mean mixes in off-policy weights."""
    mine = torch.tensor([it.rollout.member == index and it.rollout.policy_version == version for it in items])
    if not bool(mine.any()):  # a peers' micro-batch: no copy of its log-probs off the device
        return torch.zeros(0)
    tokens = torch.repeat_interleave(mine, (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long())
    tokens &= batch.targets >= 0  # not a target the loss left out (ignore_index: hacpo's final EOS)
    ratio = (logprobs.detach().float().cpu() - batch.gen_logprobs.float()).clamp(max=20.0).exp()[tokens]
    return ratio[ratio.isfinite()]


def stand_in(member) -> None:
    """A sharded member's round without a micro-batch of its own: one token through the FSDP2 root, its loss zero
    times everything it touched, so that every layer is gathered and every gradient reduced as on the other ranks
    (each parameter's gradient gets a zero, or a NaN if the model has diverged, which the caller then reports)."""
    device = member.device

    def zero(hidden, weight, bias):
        total = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0.0)
        return SimpleNamespace(loss=total * 0.0)

    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with member.autocast():
        total = member.policy(token, token, torch.zeros(1, dtype=torch.long, device=device), zero)[0]
    total.backward()


class DivergenceError(RuntimeError):
    """A member's loss, gradient, hidden states or weights turned NaN or inf: training stops. A non-finite loss or
    gradient is never stepped on; weights an optimizer step made non-finite are never saved (checkpoint.py
    refuses them), so the newest complete checkpoint stays the last good state."""


def update_member(member, items: list[TrainItem], cfg: LossConfig, token_budget: int, backend: str,
                  on_micro_batch=None, epochs: int = 1, parts: int = 1) -> dict[str, float]:
    """The update of `member` on one step's `items`: `epochs` passes, each `parts` optimizer steps on mini-batches of
    whole groups (train.epochs, train.mini_batches; one step by default). With more than one step, the log-probs
    of the step's starting policy are recorded first and are the loss's old_logprobs, so the PPO clip acts from
    the second step on. Returns the stats of all its optimizer steps together: loss, grad_norm and the loss stats
    averaged over them, own_ratio_mean of the first (the on-policy check), and optimizer_steps."""
    if not items:  # every own group unscored and nothing from peers (yet): a step with nothing to learn from
        return nothing_to_train()
    if epochs * parts == 1:
        return optimizer_step(member, items, cfg, token_budget, backend, on_micro_batch)
    items = with_old_logprobs(member, items, cfg, token_budget, backend)
    plan = [part for _ in range(epochs) for part in mini_batches(items, parts)]
    steps = []
    for k, part in enumerate(plan):
        try:
            steps.append(optimizer_step(member, part, cfg, token_budget, backend, on_micro_batch, mini_batch_index=k))
        except DivergenceError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise DivergenceError(f"{exc} (optimizer step {k + 1} of the step's {len(plan)}: the {k} before it "
                                  "were taken)") from None
    merged = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]
              if key not in ("own_ratio_mean", "micro_batches")}
    # the on-policy check: the first optimizer step that had own tokens (a mini-batch may hold only peers')
    own = next((s["own_ratio_mean"] for s in steps if not math.isnan(s["own_ratio_mean"])), float("nan"))
    return {**merged, "own_ratio_mean": own, "optimizer_steps": len(steps),
            "micro_batches": sum(s["micro_batches"] for s in steps)}


def nothing_to_train() -> dict[str, float]:
    """The stats of a step that had no rollout to train on (no optimizer step is taken, the weights stay): NaN where
    there is nothing to average, as an empty step's reward_mean is."""
    nan = float("nan")
    return {"loss": nan, **dict.fromkeys(STAT_KEYS, nan), "grad_norm": nan, "own_ratio_mean": nan,
            "micro_batches": 0, "optimizer_steps": 0}


@torch.no_grad()
def with_old_logprobs(member, items: list[TrainItem], cfg: LossConfig, token_budget: int,
                      backend: str) -> list[TrainItem]:
    """The items with the step's starting policy's log-probs of their completion tokens (old_logprobs), from the
    same forward the update runs (train mode, the same micro-batches), so the first optimizer step's ratio is 1."""
    member.model.train()
    out: list[TrainItem] = []
    for batch_items in micro_batches(items, token_budget, keep_groups=cfg.base_method == "gepo",
                                     shared_prompt=member.shared_prompt):
        batch = pack(batch_items, member.shared_prompt)
        logprobs = batch_loss(member, batch, cfg, backend).logprobs.float().cpu()
        bounds = batch.cu_seqlens.tolist()
        out += [dataclasses.replace(item, old_logprobs=logprobs[bounds[k]:bounds[k + 1]].clone())
                for k, item in enumerate(batch_items)]
    order = {id(item.rollout): i for i, item in enumerate(items)}
    return sorted(out, key=lambda item: order[id(item.rollout)])


def rollout_logprobs(member, rollouts: list, prompts: list[list[int]], cfg: LossConfig, token_budget: int,
                     backend: str) -> list[torch.Tensor]:
    """The member's [L] log-probs of each rollout's completion tokens after its prompt (no grad; the update's own
    forward, as with_old_logprobs): what a receiver's screen and an attacker's claims read."""
    items = [TrainItem(r, prompt, 0.0, k) for k, (r, prompt) in enumerate(zip(rollouts, prompts, strict=True))]
    return [it.old_logprobs for it in with_old_logprobs(member, items, cfg, token_budget, backend)]


def optimizer_step(member, items: list[TrainItem], cfg: LossConfig, token_budget: int, backend: str,
                   on_micro_batch=None, mini_batch_index: int | None = None) -> dict[str, float]:
    """One optimizer step of `member` on `items`: gradients, clipping to members.N.grad_clip, Adam step.
    mini_batch_index: which of the step's optimizer steps this is (from 0; hacpo's m)."""
    member.model.train()
    member.optimizer.zero_grad(set_to_none=True)
    try:
        stats = accumulate_gradients(member, items, cfg, token_budget, backend, on_micro_batch, mini_batch_index)
    except NonFiniteInputError as exc:
        member.optimizer.zero_grad(set_to_none=True)
        # from None: a one-line error for the user; the cause adds nothing to it
        raise DivergenceError(f"the model's hidden states became NaN or inf ({exc}); no step was taken") from None
    params = member.trainable_parameters()
    grad_norm = float(full(torch.nn.utils.clip_grad_norm_(params, member.settings.grad_clip)))
    for what, value in (("loss", stats["loss"]), ("gradient norm", grad_norm)):
        if not math.isfinite(value):  # never step on it: the weights stay those of the last good step
            member.optimizer.zero_grad(set_to_none=True)
            raise DivergenceError(f"the {what} is {value}; no step was taken")
    member.optimizer.step()
    member.optimizer.zero_grad(set_to_none=True)
    if not weights_finite(params, member.shard):
        raise DivergenceError(f"the optimizer step made the weights NaN or inf (gradient norm {grad_norm:.3g} "
                              f"before clipping to {member.settings.grad_clip:g}); they are not saved")
    stats["grad_norm"] = grad_norm
    return stats


def weights_finite(params: list[torch.Tensor], shard: Shard) -> bool:
    """Every weight is finite (a sharded member: on every shard, agreed)."""
    finite = bool(torch.stack([local(p.detach()).isfinite().all() for p in params]).all()) if params else True
    return shard.all_true(finite)


