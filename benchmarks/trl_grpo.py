"""TRL's GRPOTrainer on one member's shape: the other side of the per-step comparison with ftis-engine alone
(issue 28; ours is configs/gpu/alone-shape-1.5b.yaml, run by benchmarks/run_pair_gpu.sh in the same sitting).

What it runs, matched to that config (`--like CONFIG [--set KEY=VALUE ...]` reads every setting below that TRL
can take from ours' config: `like_ours`; the defaults are the 2026-11-27 run's):

- model: ftis-engine's built-in loader (random weights, Qwen2.5-1.5B's layer shapes by default, seed 0 as the
  config's member 0), saved with its tokenizer by the vLLM generator's own `save_for_engine`, loaded back with the
  attention of `--attn` and handed to TRL as a model. `--model builtin:shape-1.5b-qwen` takes Qwen2.5's vocabulary
  (151,936 ids, the packaged Qwen2.5-Coder's tokenizer) where the default's shipped tokenizer has 101 ids;
- attention (`--attn`): `sdpa` (the 2026-11-27 run: TRL's padded micro-batches with their padding mask) or
  `varlen`, ours' own (`ftis_engine.model.attention`: torch's FlashAttention-2 varlen kernel, what ours'
  `train.attn_implementation: varlen` runs): each padded micro-batch's tokens are packed into one row, one
  sequence a row of the batch, attended by ours' function and put back (`padded_varlen_attention`), as
  transformers' flash_attention_2 treats a padded batch; TRL's GRPO trainer packs nothing itself;
- precision (`--precision`): `fp32-master` (the default, as ours trains: float32 weights and AdamW states, bf16
  compute under autocast, TRL's `bf16=True` on a float32 model), `bf16` (weights and states in bf16: the
  2026-11-27 run, benchmarks/results/pair_h200) or `fp32` (the CPU quick mode's);
- decoder layers (`--layers`): compiled one at a time as ours compiles them (ftis_engine.model.layers.compile_layers) or
  eager; `auto` as ours' `train.layers: auto`: compiled on a GPU, eager on a CPU. The 2026-11-27 run was eager;
- prompts: the built-in task's training questions (tiny-last), prompted as the engine prompts them; the reward
  wraps the task's own reward;
- batch: 12 prompts x 12 completions = 144 a step (one member's half of the paper's 24 x 12), one optimizer
  step per generation: 16 completions a forward/backward x 9 accumulation steps (ours packs 8,192 tokens a
  micro-batch: about 15 completions of ~530 tokens);
- generation: vLLM colocate, 0.3 of the GPU (`--gpu-memory-utilization`) or, with `--kv-cache-gib`, a KV cache of
  that size as ours' `members.N.vllm.kv_cache_gib` gives its engine (vLLM's kv_cache_memory_bytes), sleep mode on (TRL sleeps at level 2 and pushes every weight each
  step; ours sleeps at level 1 and pushes them at wake-up), temperature 1, top_p 1, up to 512 new tokens, a
  context of 512 prompt tokens + 512 (ours: data.max_prompt_tokens + max_new_tokens), and ours' compilation
  setting (inductor's combo kernels off; TRL's engine is otherwise TRL's own: compiled, CUDA graphs);
- loss: `loss_type="grpo"` (the mean over sequences of each sequence's token mean: our `normalization:
  sequence`), epsilon 0.2, beta 0 (no reference model), group-scaled advantages, and TRL's vLLM importance
  correction `token_truncate` capped at 2: our TIS weight min(exp(l - g), C = 2). TRL takes l from an extra
  no-grad forward over the whole batch before the update; ours reuses the update's own forward. TRL has no
  F-TIS filter, which on a member's own rollouts (KL ~ 0) filters nothing anyway;
- optimizer: AdamW at a constant 1e-6, no weight decay, gradient clip 1.0 (ours: Adam, same numbers);
  activation checkpointing (non-reentrant) on both sides.

The JSON's `settings` say what ran, in the words benchmarks/pair_summary.py compares both sides in: precision
(the compute dtype), master_dtype, attention, compile (the decoder layers: compile or eager), vocab_size, batch
(completions a step) and length (new tokens).

The JSON is written after every step as well as at the end, so a run stopped midway (a device call's time
running out) leaves the steps it finished.

Seconds per step: a TrainerCallback between on_step_begin and on_step_end (generation, scoring, every
micro-batch and the optimizer step), CUDA synchronised at both ends; inside it, generation (TRL's
`_generate_single_turn`: wake, generate, sleep), weight sync (`sync_weights`) and scoring (the rest of
`_generate_and_score_completions`: decoding, reward, the old-log-prob forward) are timed by wrapping those
methods, and the remainder is the update. Tokens generated are counted in the reward function (it sees every
completion's ids). Peak memory: torch's max_memory_allocated and the device's used memory at each step's end
(the runner also samples nvidia-smi, which sees vLLM's pool as well).

    python benchmarks/trl_grpo.py --like configs/gpu/alone-shape-1.5b.yaml --output trl.json   # as ours alone runs
    python benchmarks/trl_grpo.py --output /tmp/pair-results/trl.json                # GPU, vLLM colocate
    python benchmarks/trl_grpo.py --precision bf16 --layers eager --output x.json    # as run on 2026-11-27
    python benchmarks/trl_grpo.py --quick --output /tmp/trl-quick.json               # CPU, no vLLM: a smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from importlib.metadata import PackageNotFoundError, version

import torch

GIB = 2**30
PROMPT_TOKENS = 512  # the engine's data.max_prompt_tokens default: its vLLM context is this + max_new_tokens
# --precision: (weights and optimizer states, compute); bf16 compute on float32 weights is autocast (TRL's bf16=True)
PRECISIONS = {"fp32-master": (torch.float32, torch.bfloat16), "bf16": (torch.bfloat16, torch.bfloat16),
              "fp32": (torch.float32, torch.float32)}
LAYERS = ("auto", "eager", "compile")


# the GRPOConfig fields the JSON records (after TRL's own defaults and derivations)
GRPO_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
               "steps_per_generation", "num_generations", "max_completion_length", "loss_type", "beta", "epsilon",
               "scale_rewards", "bf16", "gradient_checkpointing", "optim", "lr_scheduler_type", "learning_rate")
VLLM_FIELDS = ("vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_max_model_length",
               "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
               "vllm_importance_sampling_clip_max")


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseClock:
    """Seconds per phase since the last reset, each phase timed by wrapping a method; a phase timed inside
    another is taken out of the outer one (a weight sync inside generation counts as weight sync only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # seconds of nested phases, per open phase

    def reset(self) -> None:
        self.seconds = defaultdict(float)

    def wrap(self, owner, attribute: str, phase: str) -> bool:
        """Time `owner.attribute` as `phase` (an instance attribute shadows the method); False if it has none."""
        method = getattr(owner, attribute, None)
        if not callable(method):
            return False

        def timed(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            self._inner.append(0.0)
            try:
                return method(*args, **kwargs)
            finally:
                synchronize()
                elapsed = time.perf_counter() - start
                self.seconds[phase] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        setattr(owner, attribute, timed)
        return True


def step_callback(clock: PhaseClock, tally: dict, steps: list[dict], logged: list[dict], after_step=None):
    """A TrainerCallback that appends one record per optimizer step to `steps` and TRL's logged numbers to
    `logged`, then calls `after_step()` (the JSON so far)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            synchronize()
            self.last_end = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            clock.reset()
            tally.update(tokens=0, completions=0)
            synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            end = time.perf_counter()
            seconds = end - self.start
            phases = {k: clock.seconds.get(k, 0.0) for k in ("gen_seconds", "weight_sync_seconds", "score_seconds")}
            record = {"step": state.global_step, "seconds": seconds, **phases,
                      "update_seconds": seconds - sum(phases.values()),
                      "since_last_step_seconds": end - self.last_end,  # the loop between steps (logging) as well
                      "tokens": tally["tokens"], "completions": tally["completions"]}
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                record.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                              device_used_gib=(total - free) / GIB)
            steps.append(record)
            self.last_end = end
            print(f"step {record['step']}: {seconds:.2f} s (generation {phases['gen_seconds']:.2f}, weight sync "
                  f"{phases['weight_sync_seconds']:.2f}, scoring {phases['score_seconds']:.2f}, update "
                  f"{record['update_seconds']:.2f}), {record['tokens']} tokens", flush=True)
            if after_step is not None:
                after_step()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logged.append({"step": state.global_step,
                               **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})
                if after_step is not None and steps and logged[-1]["step"] == steps[-1]["step"]:
                    after_step()  # TRL logs a step after its on_step_end: the JSON gets that step's log too

    return StepTimer()


def task_reward(task, tally: dict):
    """The task's reward as a TRL reward function (plain callable: completions in, one float each out); also
    counts the completions' tokens into `tally`."""

    def reward(completions, completion_ids, answer, **_):
        tally["tokens"] += sum(len(ids) for ids in completion_ids)
        tally["completions"] += len(completion_ids)
        return [float(task.reward(text, gold)) for text, gold in zip(completions, answer, strict=True)]

    reward.__name__ = f"{task.name.replace('-', '_')}_reward"
    return reward


def task_dataset(task, tokenizer):
    """The task's training questions as TRL prompts (the engine's own prompt text), with their gold answers."""
    from datasets import Dataset

    from ftis_engine.data.tasks import prompt_text

    return Dataset.from_dict({"prompt": [prompt_text(tokenizer, task, ex.question) for ex in task.train],
                              "answer": [ex.answer for ex in task.train]})


def export_model(spec: str, seed: int, dtype: torch.dtype, directory: pathlib.Path):
    """Build the built-in model as ftis-engine builds member 0 (same seed, on the same device: a GPU's draws differ
    from the CPU's) and save it with its tokenizer where TRL and vLLM load from; returns the tokenizer. (Its
    attention is the trainer's to choose when it loads the files: trainer_model.)"""
    from ftis_engine.generation.engine_weights import save_for_engine
    from ftis_engine.model.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(spec)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")  # configs/gpu/alone-shape-1.5b.yaml's
    model = load_model(spec, len(tokenizer), dtype, seed, "sdpa", device)
    save_for_engine(model, tokenizer, directory)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokenizer


def padded_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface for TRL's padded micro-batches, through ours' varlen attention
    (ftis_engine.model.attention.varlen_attention: torch's FlashAttention-2 varlen kernel on a packed row). query
    [B, H, T, D], key and value [B, H_kv, T, D], attention_mask [B, T] (1 = a token) or None; returns [B, T, H, D]
    and no weights. The tokens of each row are packed one row after the other, positions restarting at 0 for each
    (the sequence bounds ours reads), so each attends causally to the tokens before it in its own row, padding
    skipped: what sdpa computes under a causal and padding mask. Padding positions get zeros (the loss reads none
    of them). A query shorter than its key (decoding with a cache; TRL generates with vLLM) goes to ours' function
    as it is."""
    from ftis_engine.model import attention

    if query.shape[2] != key.shape[2]:
        return attention.varlen_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    batch, heads, length, width = query.shape
    keep = (attention_mask[:, -length:].bool() if attention_mask is not None
            else torch.ones(batch, length, dtype=torch.bool, device=query.device))
    lengths = keep.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(int(lengths.sum()), device=query.device) - torch.repeat_interleave(starts, lengths)

    def packed(x):  # [B, H, T, D] -> [1, H, N, D]: the kept tokens of every row, one row after the other
        return x.transpose(1, 2)[keep].transpose(0, 1)[None]

    out, _ = attention.varlen_attention(module, packed(query), packed(key), packed(value), None, scaling, dropout,
                                        position_ids=positions[None])
    full = out.new_zeros(batch, length, heads, width)
    full[keep] = out[0]
    return full, None


def register_padded_varlen() -> None:
    """Make `varlen` load TRL's model with padded_varlen_attention (and the padding mask passed through as ours'
    varlen takes it): ours' function under ours' name, for padded batches."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    from ftis_engine.model import attention

    AttentionInterface.register(attention.NAME, padded_varlen_attention)
    AttentionMaskInterface.register(attention.NAME, flash_attention_mask)


def trainer_model(directory: pathlib.Path, master: torch.dtype, attn: str, layer_mode: str):
    """The model TRL trains: the exported one loaded back with its weights in `master` (float32 masters, or bf16)
    and attention `attn` (`varlen`: padded_varlen_attention), its decoder layers compiled as ours compiles them when
    `layer_mode` is `compile`."""
    from transformers import AutoModelForCausalLM

    from ftis_engine.model import attention, layers

    if attn == attention.NAME:
        register_padded_varlen()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=master, attn_implementation=attn)
    layers.compile_layers(model, layer_mode)
    return model


def engine_as_ours(kv_cache_gib: float | None = None) -> None:
    """TRL builds its vLLM engine with arguments of its own: give it ours' compilation setting (inductor's combo
    kernels off, which with torch 2.11 fail an assertion compiling a Qwen2: ftis_engine/generation/vllm.py), so that
    both engines compile the same kernels, and ours' dtype, bf16 (TRL leaves it to the saved weights' dtype: float32
    masters would have it generate in float32), and, given `kv_cache_gib`, the KV cache ours' members.N.vllm.
    kv_cache_gib gives ours' engine (vLLM's kv_cache_memory_bytes, in place of a share of the GPU). Everything else
    of TRL's engine stays TRL's."""
    import trl.generation.vllm_generation as trl_vllm

    from ftis_engine.generation.vllm import COMPILATION_CONFIG

    engine = trl_vllm.LLM

    def llm(*args, **kwargs):
        kwargs.setdefault("compilation_config", copy.deepcopy(COMPILATION_CONFIG))
        kwargs.setdefault("dtype", "bfloat16")
        if kv_cache_gib is not None:
            kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * GIB))
        return engine(*args, **kwargs)

    trl_vllm.LLM = llm


def grpo_config(args, work: pathlib.Path):
    from trl import GRPOConfig

    batch = args.prompts * args.group
    options = {
        "output_dir": str(work / "trainer"), "max_steps": args.steps, "seed": args.seed,
        "per_device_train_batch_size": args.micro_batch, "gradient_accumulation_steps": batch // args.micro_batch,
        "num_generations": args.group, "max_completion_length": args.max_new_tokens,
        "temperature": args.temperature, "top_p": 1.0,
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "beta": 0.0, "epsilon": 0.2, "loss_type": "grpo", "scale_rewards": "group",
        "num_iterations": 1, "bf16": PRECISIONS[args.precision][1] == torch.bfloat16,
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "use_vllm": args.vllm, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "dataloader_num_workers": 0, "use_cpu": args.quick or not torch.cuda.is_available(),
    }
    if args.vllm:
        options.update({
            "vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.gpu_memory_utilization,
            "vllm_enable_sleep_mode": not args.no_sleep,
            "vllm_max_model_length": PROMPT_TOKENS + args.max_new_tokens,
            "vllm_importance_sampling_correction": not args.no_is_correction,
            "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0,
        })
    return GRPOConfig(**options)


def summarize(steps: list[dict], logs: list[dict]) -> dict:
    """Medians over the steps (the first, with its warm-up, included: the runner's summary can leave it out),
    tokens/s over all of them, the peaks, and TRL's own mean importance ratio and completion length."""
    seconds = [s["seconds"] for s in steps]
    out = {"steps": len(steps), "median_step_seconds": statistics.median(seconds) if seconds else None,
           "tokens_per_s": sum(s["tokens"] for s in steps) / sum(seconds) if seconds else None}
    for key in ("gen_seconds", "weight_sync_seconds", "score_seconds", "update_seconds"):
        out[f"median_{key}"] = statistics.median(s[key] for s in steps) if steps else None
    for key in ("peak_allocated_gib", "device_used_gib"):
        values = [s[key] for s in steps if key in s]
        out[f"{key}_max"] = max(values) if values else None
    for key, name in (("sampling/importance_sampling_ratio/mean", "is_weight_mean"), ("step_time", "trl_step_time"),
                      ("completions/mean_length", "completion_len_mean"),
                      ("completions/clipped_ratio", "truncated_frac")):
        values = [log[key] for log in logs if key in log]
        out[name] = statistics.fmean(values) if values else None
    return out


def like_ours(path: str, sets: list[str]) -> dict:
    """The arguments that run TRL as ours' config runs its member 0 (`--like CONFIG [--set KEY=VALUE ...]`): model
    and its init seed, task, steps, batch, length, temperature, learning rate, attention, compiled layers, precision
    and the engine's memory. What TRL cannot take from it: its micro-batches (16 completions), its engine's sleep
    level (2, colocated) and seeding (once), recorded in the JSON's settings."""
    from ftis_engine.config import ConfigError, load_config
    from ftis_engine.member.members import member_init_seed

    config = load_config(path, sets)
    member = config.members[0]
    if member.master_dtype == "float32" and member.dtype in ("auto", "bfloat16"):
        precision = "fp32-master"
    elif member.master_dtype == "bfloat16":
        precision = "bf16"
    else:
        precision = "fp32"
    if config.train.attn_implementation not in ("sdpa", "varlen", "eager"):
        raise ConfigError(f"train.attn_implementation: {config.train.attn_implementation} has no TRL twin here "
                          "(sdpa, varlen or eager)")
    return {"model": member.model, "seed": member_init_seed(config, 0), "task": config.data.task,
            "steps": config.train.steps, "prompts": config.rollout.prompts_per_step,
            "group": config.rollout.group_size, "max_new_tokens": config.rollout.max_new_tokens,
            "temperature": config.rollout.temperature, "lr": member.lr, "attn": config.train.attn_implementation,
            "layers": config.train.layers, "precision": precision,
            "gpu_memory_utilization": member.vllm.gpu_memory_utilization, "kv_cache_gib": member.vllm.kv_cache_gib}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", metavar="CONFIG",
                        help="take every setting ours' config gives its member 0 (like_ours); flags given as well win")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="an override of the --like config, as ftis-engine train --set")
    parser.add_argument("--model", default="builtin:shape-1.5b")
    parser.add_argument("--task", default="tiny-last")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per step")
    parser.add_argument("--group", type=int, default=12, help="completions per prompt (num_generations)")
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "varlen", "eager"),
                        help="the trained model's attention: sdpa (padded micro-batches under their mask) or varlen "
                             "(ours': each micro-batch packed for torch's FlashAttention-2 varlen kernel; a GPU)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="fp32-master (default: float32 weights and AdamW states, bf16 autocast, as ours), bf16 "
                             "(pure bf16, the 2026-11-27 run) or fp32 (the default with --quick)")
    parser.add_argument("--layers", choices=LAYERS, default="auto",
                        help="decoder layers compiled as ours compiles them, or eager; auto: compiled on a GPU (ours' "
                             "train.layers: auto)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="the engine's share of the GPU (with --kv-cache-gib: vLLM's start-up check alone)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes), as ours' "
                             "members.N.vllm.kv_cache_gib")
    parser.add_argument("--no-sleep", action="store_true", help="keep the vLLM engine awake during updates")
    parser.add_argument("--no-is-correction", action="store_true",
                        help="no vLLM importance correction (and no old-log-prob forward)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke test: builtin:tiny-s, 2 steps of 2 x 4 completions of 8 tokens, no vLLM")
    parser.add_argument("--output", required=True, help="the JSON written")
    args = parser.parse_args(argv)
    if args.like:  # ours' settings become the defaults; the flags given on the command line still win
        parser.set_defaults(**like_ours(args.like, args.sets))
        args = parser.parse_args(argv)
    elif args.sets:
        parser.error("--set overrides the --like config: give --like")
    if args.quick:
        args.model, args.steps, args.prompts, args.group, args.micro_batch, args.max_new_tokens = (
            "builtin:tiny-s", 2, 2, 4, 4, 8)
    args.vllm = not args.quick
    args.precision = args.precision or ("fp32" if args.quick else "fp32-master")
    if (args.prompts * args.group) % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide the step's {args.prompts} x {args.group} "
                     "completions")
    return args


def result_json(args, config, settings, timed, init_seconds, error, steps, logs) -> dict:
    """The JSON: what ran (device, versions, config, settings), how far it got and the steps so far."""
    grpo = {k: getattr(config, k, None) for k in GRPO_FIELDS + (VLLM_FIELDS if args.vllm else ())} if config else {}
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})",
        "versions": {name: package_version(name) for name in ("torch", "transformers", "trl", "vllm", "accelerate",
                                                                "datasets")},
        "python": platform.python_version(), "command": " ".join([sys.executable, *sys.argv]),
        "config": {"model": args.model, "task": args.task, "steps": args.steps, "prompts": args.prompts,
                   "group": args.group, "micro_batch": args.micro_batch, "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "lr": args.lr, "attn": args.attn, "seed": args.seed,
                   "use_vllm": args.vllm, "quick": args.quick, "precision": args.precision, "layers": args.layers,
                   "kv_cache_gib": args.kv_cache_gib, "like": args.like, "sets": args.sets,
                   "grpo": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                            for k, v in grpo.items()}},
        "settings": settings, "phases_timed": timed, "init_seconds": init_seconds, "error": error,
        "steps": steps, "summary": summarize(steps, logs), "logs": logs,
    }


def engine_levers(args) -> dict:
    """TRL's engine as pair_summary.LEVERS names ours': colocated TRL sleeps at level 2 (trl/generation/
    vllm_generation.py) and seeds its engine once (no seed per request); its KV cache and GPU share as given."""
    if not args.vllm:
        return {}
    return {"sleep_level": 0 if args.no_sleep else 2, "seeds": "one stream",
            "kv_cache_gib": args.kv_cache_gib if args.kv_cache_gib is not None else "share",
            "gpu_memory_utilization": args.gpu_memory_utilization}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; the GPU machine has no network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trl import GRPOTrainer

    from ftis_engine.model import layers
    from ftis_engine.config import DataSettings
    from ftis_engine.data.tasks import load_task

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps: list[dict] = []
    logs: list[dict] = []
    tally = {"tokens": 0, "completions": 0}
    clock = PhaseClock()
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    ran = {"config": None, "settings": None, "timed": {}, "init_seconds": None, "error": None}

    def write() -> dict:  # after every step and at the end: a run cut off midway keeps the steps it finished
        result = result_json(args, steps=steps, logs=logs, **ran)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(result, indent=2) + "\n")
        partial.replace(out)
        return result

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        work = pathlib.Path(tmp)
        master, compute = PRECISIONS[args.precision]
        device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
        layer_mode = layers.resolve(args.layers, device)
        tokenizer = export_model(args.model, args.seed, master, work / "model")
        task = load_task(DataSettings(task=args.task), args.seed)
        ran["config"] = config = grpo_config(args, work)
        if args.vllm:
            engine_as_ours(args.kv_cache_gib)
        model = trainer_model(work / "model", master, args.attn, layer_mode)
        ran["settings"] = {"precision": str(compute).removeprefix("torch."),
                           "master_dtype": str(master).removeprefix("torch."), "attention": args.attn,
                           "compile": "compile" if layers.compiled(model) else "eager",
                           "vocab_size": model.get_output_embeddings().weight.shape[0],
                           "batch": args.prompts * args.group, "length": args.max_new_tokens, **engine_levers(args)}
        start = time.perf_counter()
        try:  # the trainer's start (its vLLM engine) may fail too: the JSON still says what stopped the run
            trainer = GRPOTrainer(model=model, reward_funcs=task_reward(task, tally), args=config,
                                  train_dataset=task_dataset(task, tokenizer), processing_class=tokenizer,
                                  callbacks=[step_callback(clock, tally, steps, logs, after_step=write)])
            ran["init_seconds"] = time.perf_counter() - start
            ran["timed"] = {"gen_seconds": clock.wrap(trainer, "_generate_single_turn", "gen_seconds"),
                            "score_seconds": clock.wrap(trainer, "_generate_and_score_completions", "score_seconds"),
                            "weight_sync_seconds": args.vllm and clock.wrap(getattr(trainer, "vllm_generation", None),
                                                                            "sync_weights", "weight_sync_seconds")}
            trainer.train()
        except Exception as exc:  # noqa: BLE001 (keep the steps done so far: the JSON says what stopped the run)
            traceback.print_exc()
            ran["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    result = write()
    s, error = result["summary"], ran["error"]
    if error is not None:
        print(f"TRL stopped after {s['steps']} steps ({error}); wrote {out}")
        return 1
    if not s["steps"]:
        print(f"TRL trained no step; wrote {out}")
        return 0
    print(f"TRL {result['versions']['trl']} on {result['device']}: median {s['median_step_seconds']:.2f} s/step "
          f"over {s['steps']} steps, {s['tokens_per_s']:.0f} generated tokens/s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
