"""The step loop. Per step, every member:

    1. generates G completions for its prompts (vertical: its share of the step's prompts; horizontal: its
       share of every prompt's group) and scores them,
    2. shares them (token ids + generation log-probs) and receives its peers' (validated and re-scored),
    3. computes group advantages A_i = (r_i - mean r) / (std r + 1e-8) over each prompt's group,
    4. takes one F-TIS step on all of them (its own on-policy, its peers' off-policy), and syncs its generator.
Evaluation (greedy pass@1) at step 0, every eval.every steps and at the end; checkpoints every checkpoint.every.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import random
import time
from dataclasses import dataclass, field

import torch
from ftis_kernels import group_advantages

from .checkpoint import finalize_checkpoint, latest_checkpoint, read_state, restore_member, stage_members
from .config import ConfigError, RunConfig, dump_config
from .evaluate import evaluate_member
from .exchange import LocalExchange, RolloutChecker, receive
from .generation import SamplingSettings
from .members import Member, build_member, preflight, resolve_device
from .metrics import MetricsLogger, truncate_metrics
from .progress import Progress
from .rollouts import Rollout, TrainItem, encode, max_buffer_words, wire_bytes
from .tasks import Task, load_task, prompt_ids
from .update import check_model, update_member

log = logging.getLogger("ftis_engine")


@dataclass
class Swarm:
    """Everything one process needs to run its members' steps."""

    config: RunConfig
    task: Task
    members: list[Member]  # the members this process holds
    exchange: object
    run_dir: pathlib.Path
    logger: MetricsLogger | None
    progress: Progress
    train_indices: list[int]  # training prompts that fit data.max_prompt_tokens
    names: list[str]
    prompt_cache: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.exchange.rank == 0

    def prompt(self, member: Member, index: int) -> list[int]:
        key = (member.index, index)
        if key not in self.prompt_cache:
            self.prompt_cache[key] = prompt_ids(member.tokenizer, self.task, self.task.train[index].question)
        return self.prompt_cache[key]


# ----------------------------------------------------------------------------------------------- who does what


def prompts_for_step(step: int, indices: list[int], per_step: int, seed: int, shuffle: bool) -> list[int]:
    """The step's prompts (step >= 1): the next slice of this epoch's permutation of the training set, identical
    in every process (no communication needed). An epoch is floor(len / per_step) whole slices, so a step never
    holds a prompt twice (the few left over join the next epoch's shuffle)."""
    if len(indices) < per_step:
        raise ValueError(f"rollout.prompts_per_step={per_step} exceeds the {len(indices)} usable training prompts")
    epoch, slot = divmod(step - 1, len(indices) // per_step)
    order = list(indices)
    if shuffle:
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return order[slot * per_step : (slot + 1) * per_step]


def deal(prompts: list[int], member: int, num_members: int, collaboration: str, group_size: int) -> list[tuple[int, int]]:
    """(prompt index, completions to generate) for one member. vertical/alone: prompts dealt round-robin, the
    whole group each; horizontal: every prompt, the member's share of its group."""
    if collaboration == "horizontal":
        share = group_size // num_members + (1 if member < group_size % num_members else 0)
        return [(p, share) for p in prompts] if share else []
    return [(p, group_size) for i, p in enumerate(prompts) if i % num_members == member]


def sampling_seed(seed: int, step: int, member: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + member * 104_729) % (2**31 - 1)


# ----------------------------------------------------------------------------------------------- one step


def generate_rollouts(swarm: Swarm, member: Member, step: int, assignment: list[tuple[int, int]]) -> list[Rollout]:
    rollout_cfg = swarm.config.rollout
    rollouts: list[Rollout] = []
    by_n: dict[int, list[int]] = {}
    for prompt, n in assignment:
        by_n.setdefault(n, []).append(prompt)
    total = sum(n for _, n in assignment)
    task_id = swarm.progress.start(f"{member.name}: generate", total)
    for n, prompts in by_n.items():
        sampling = SamplingSettings(n=n, max_new_tokens=rollout_cfg.max_new_tokens, temperature=rollout_cfg.temperature,
                                    top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                                    seed=sampling_seed(swarm.config.seed, step, member.index))
        groups = member.generator.generate([swarm.prompt(member, p) for p in prompts], sampling,
                                           on_batch=lambda k: swarm.progress.advance(task_id, k))
        for prompt, completions in zip(prompts, groups):
            texts = member.tokenizer.batch_decode([c.token_ids.tolist() for c in completions], skip_special_tokens=True)
            for completion, text in zip(completions, texts):
                rollouts.append(Rollout(
                    member=member.index, prompt_index=prompt, completion_ids=completion.token_ids,
                    gen_logprobs=completion.logprobs, reward=float(swarm.task.reward(text, swarm.task.train[prompt].answer)),
                    finish_reason=completion.finish_reason, policy_version=step - 1,
                ))
    swarm.progress.finish(task_id)
    return rollouts


def training_items(swarm: Swarm, member: Member, rollouts: list[Rollout]) -> list[TrainItem]:
    """Advantages over each prompt's group (vertical: one member's G; horizontal: the swarm's G)."""
    rewards = torch.tensor([r.reward for r in rollouts])
    groups = torch.tensor([r.prompt_index for r in rollouts])
    advantages = group_advantages(rewards, groups, scale=swarm.config.algorithm.scale_rewards == "group")
    return [TrainItem(r, swarm.prompt(member, r.prompt_index), float(a), r.prompt_index)
            for r, a in zip(rollouts, advantages)]


def run_step(swarm: Swarm, step: int) -> list[dict]:
    config = swarm.config
    num_members = len(config.members)
    prompts = prompts_for_step(step, swarm.train_indices, config.rollout.prompts_per_step, config.seed,
                               config.data.shuffle)
    assignments = {m: deal(prompts, m, num_members, config.collaboration, config.rollout.group_size)
                   for m in range(num_members)}

    own: dict[int, list[Rollout]] = {}
    gen_seconds: dict[int, float] = {}
    for member in swarm.members:
        start = time.perf_counter()
        member.generator.wake_up()
        own[member.index] = generate_rollouts(swarm, member, step, assignments[member.index])
        member.generator.sleep()
        gen_seconds[member.index] = time.perf_counter() - start

    sharing = config.collaboration != "alone"
    buffers = {m: encode(rollouts) for m, rollouts in own.items()}
    start = time.perf_counter()
    if sharing:
        swarm.exchange.barrier()  # waiting for slower peers is not the exchange's cost: time it apart
    exchange_wait = time.perf_counter() - start
    limits = {m: max_buffer_words(sum(n for _, n in a), config.rollout.max_new_tokens) for m, a in assignments.items()}
    received = swarm.exchange.share(buffers, limits) if sharing else buffers
    exchange_seconds = time.perf_counter() - start - exchange_wait

    records = []
    loss_cfg = config.algorithm.loss_config(config.rollout.temperature)
    for member in swarm.members:
        checker = RolloutChecker(
            tokenizer=member.tokenizer, reward=swarm.task.reward, golds=[ex.answer for ex in swarm.task.train],
            vocab_size=member.vocab_size, max_new_tokens=config.rollout.max_new_tokens,
            dealt={m: dict(a) for m, a in assignments.items()},
        )
        got = receive(received, member.index, own[member.index], checker, swarm.names) if sharing else None
        rollouts = got.rollouts if sharing else own[member.index]
        items = training_items(swarm, member, rollouts)
        start = time.perf_counter()
        task_id = swarm.progress.start(f"{member.name}: update", sum(it.rollout.num_tokens for it in items))
        stats = update_member(member, items, loss_cfg, config.train.micro_batch_tokens, config.train.backend,
                              on_micro_batch=lambda k: swarm.progress.advance(task_id, k))
        swarm.progress.finish(task_id)
        member.generator.sync(member.model)
        mine = own[member.index]
        sent_tokens = sum(r.num_tokens for r in mine) if sharing else 0
        records.append({
            "step": step, "member": member.name, "kind": "train",
            "reward_mean": _mean([r.reward for r in mine]),
            "swarm_reward_mean": _mean([r.reward for r in rollouts]),
            **{k: v for k, v in stats.items()},
            "tokens": sum(it.rollout.num_tokens for it in items),
            "sequences": len(items),
            "own_sequences": len(mine),
            "completion_len_mean": _mean([r.num_tokens for r in mine]),
            "truncated_frac": _mean([r.finish_reason == "length" for r in mine]),
            "gen_seconds": gen_seconds[member.index],
            "train_seconds": time.perf_counter() - start,
            "exchange_bytes": wire_bytes(len(mine), sent_tokens) if sharing else 0,
            "exchange_tokens": sent_tokens,
            "exchange_sequences": len(mine) if sharing else 0,
            "exchange_seconds": exchange_seconds,
            "exchange_wait_seconds": exchange_wait,
            "rollouts_sha256": buffer_digest(buffers[member.index]),
            "received_sha256": {swarm.names[m]: buffer_digest(b) for m, b in received.items() if m != member.index}
            if sharing else {},
            "rejected_batches": len(got.rejected) if sharing else 0,
            "lr": member.optimizer.param_groups[0]["lr"],
        })
    return records


def buffer_digest(buffer: torch.Tensor) -> str:
    """Fingerprint of a wire buffer (sender and receivers log it: equal digests mean bit-exact delivery)."""
    return hashlib.sha256(buffer.numpy().tobytes()).hexdigest()[:16]


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")


# ----------------------------------------------------------------------------------------------- eval, checkpoint


def evaluate_all(swarm: Swarm, step: int) -> list[dict]:
    cfg = swarm.config.eval
    max_new = cfg.max_new_tokens or swarm.config.rollout.max_new_tokens
    records = []
    for member in swarm.members:
        member.generator.wake_up()
        for name, examples in swarm.task.evals.items():
            examples = examples[: cfg.max_samples] if cfg.max_samples else examples
            task_id = swarm.progress.start(f"{member.name}: eval {name}", len(examples))
            accuracy = evaluate_member(member, swarm.task, examples, max_new,
                                       on_batch=lambda k: swarm.progress.advance(task_id, k))
            swarm.progress.finish(task_id)
            records.append({"step": step, "member": member.name, "kind": "eval", "dataset": name,
                            "accuracy": accuracy, "samples": len(examples)})
        member.generator.sleep()
    return records


def save_checkpoint(swarm: Swarm, step: int) -> None:
    cfg = swarm.config.checkpoint
    stage_members(swarm.run_dir, step, swarm.members, cfg.save_optimizer)
    swarm.exchange.barrier()  # every rank has staged its members
    if swarm.is_main:
        finalize_checkpoint(swarm.run_dir, step, {"data_position": step * swarm.config.rollout.prompts_per_step,
                                                  "members": swarm.names}, cfg.keep_last)
    swarm.exchange.barrier()


def restore(swarm: Swarm) -> int:
    """Load the newest complete checkpoint every process can see; returns its step (0 when there is none)."""
    found = latest_checkpoint(swarm.run_dir)
    step = found[0] if found else 0
    step = swarm.exchange.all_agree(step)
    if step == 0:
        return 0
    checkpoint = swarm.run_dir / "checkpoints" / f"step-{step}"
    state = read_state(checkpoint)
    if state.get("members") != swarm.names:
        raise RuntimeError(f"checkpoint {checkpoint} holds members {state.get('members')}, the config has {swarm.names}")
    for member in swarm.members:
        restore_member(member, checkpoint, load_optimizer=swarm.config.checkpoint.save_optimizer)
        member.generator.sync(member.model)
    return step


# ----------------------------------------------------------------------------------------------- the run


def summary_line(step: int, steps: int, records: list[dict]) -> str:
    parts = []
    for r in sorted(records, key=lambda r: r["kind"] == "eval"):
        if r["kind"] == "train":
            parts.append(f"{r['member']}: reward {r['reward_mean']:.3f} loss {r['loss']:+.4f} "
                         f"w {r['is_weight_mean']:.2f} filt {r['filtered_frac']:.2f}")
        else:
            parts.append(f"{r['member']}: {r['dataset']} acc {r['accuracy']:.3f}")
    return f"step {step}/{steps} | " + " | ".join(parts)


def setup_swarm(config: RunConfig, run_dir: pathlib.Path, exchange=None, local_members: list[int] | None = None,
                local_rank: int | None = None, tokenizers: list | None = None, progress: Progress | None = None) -> Swarm:
    """Build this process's members (all of them in a single-process run) and the task."""
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    exchange = exchange or LocalExchange()
    indices = local_members if local_members is not None else list(range(len(config.members)))
    if tokenizers is None:
        tokenizers = preflight(config)
    task = load_task(config.data, config.seed, config.eval.datasets)
    members = []
    for i in indices:
        device = resolve_device(config.train.device, local_rank if local_rank is not None else i)
        member = build_member(i, config, tokenizers[i], device)
        check_model(member)
        members.append(member)
    first = tokenizers[0] if tokenizers[0] is not None else members[0].tokenizer
    limit = config.data.max_prompt_tokens
    train_indices = [i for i, ex in enumerate(task.train) if len(prompt_ids(first, task, ex.question)) <= limit]
    train_indices = exchange.all_gather_object(train_indices)[0]  # every rank draws prompts from rank 0's list
    if len(train_indices) < config.rollout.prompts_per_step:
        raise ConfigError(f"data.max_prompt_tokens={limit}: only {len(train_indices)} training prompts are that "
                          f"short, fewer than rollout.prompts_per_step={config.rollout.prompts_per_step}")
    for name, examples in task.evals.items():  # eval prompts obey the same limit (a vLLM engine is sized by it)
        keep = [i for i, ex in enumerate(examples) if len(prompt_ids(first, task, ex.question)) <= limit]
        kept = [examples[i] for i in exchange.all_gather_object(keep)[0]]
        if len(kept) < len(examples):
            log.warning("eval %s: %d of %d prompts exceed data.max_prompt_tokens=%d and are left out", name,
                        len(examples) - len(kept), len(examples), limit)
        task.evals[name] = kept
    return Swarm(config, task, members, exchange, run_dir, None, progress or Progress(enabled=False), train_indices,
                 [m.name for m in config.members])


def train(config: RunConfig, run_dir: pathlib.Path, resume: bool = False, swarm: Swarm | None = None,
          console=None) -> list[dict]:
    """Run (or resume) the whole training; returns the final eval records. `swarm` may be prebuilt (distributed)."""
    progress = swarm.progress if swarm else Progress(console=console)
    swarm = swarm or setup_swarm(config, run_dir, progress=progress)
    start_step = restore(swarm) if resume else 0
    if swarm.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(config))
        truncate_metrics(run_dir / "metrics.jsonl", start_step if start_step else -1)  # step 0 is logged anew
    swarm.exchange.barrier()
    if swarm.is_main:  # rank 0 writes what every rank reports; TensorBoard forgets what the log dropped
        swarm.logger = MetricsLogger(run_dir, purge_step=start_step + 1 if start_step else 0)
    steps = config.train.steps
    final: list[dict] = []
    with progress:
        if start_step == 0 and config.eval.at_start:
            final = _log(swarm, 0, steps, evaluate_all(swarm, 0))
        for step in range(start_step + 1, steps + 1):
            records = run_step(swarm, step)
            last = step == steps
            evaluating = last or (config.eval.every and step % config.eval.every == 0)
            if evaluating:
                records += evaluate_all(swarm, step)
            logged = _log(swarm, step, steps, records)
            if evaluating:
                final = [r for r in logged if r["kind"] == "eval"]
            if last or (config.checkpoint.every and step % config.checkpoint.every == 0):
                save_checkpoint(swarm, step)
        if start_step >= steps:  # nothing left to train: report the finished run's accuracy
            final = swarm.exchange.gather_records(evaluate_all(swarm, steps))
    if swarm.is_main:
        swarm.logger.close()
        from .plots import make_plots

        make_plots(run_dir)
        (run_dir / "final_eval.json").write_text(json.dumps(final, indent=2))
    return final


def _log(swarm: Swarm, step: int, steps: int, records: list[dict]) -> list[dict]:
    """Gather every rank's records; rank 0 writes them and prints the step's summary line."""
    records = swarm.exchange.gather_records(records)
    if swarm.is_main:
        for record in records:
            swarm.logger.log(record)
        swarm.progress.print(summary_line(step, steps, records))
    return records
