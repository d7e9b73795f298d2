"""The run configuration's schema: one pydantic tree, each field with a description (docs/configuration.md is
generated from them: python docs/hooks.py) and a default that serves a first run; `ftis-engine train --dry-run` prints
the resolved tree. A field's own bounds and choices are checked where its section is declared (this module, member.py,
data.py, swarm.py); the rules between fields are in checks.py, reading the YAML and the `--set` overrides in load.py."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal

from ftis_kernels.options import LossConfig
from pydantic import Field, create_model, field_validator, model_validator

from .checks import check_run
from .data import DataSettings
from .member import MemberSettings
from .swarm import DefenseSettings, SwarmSettings
from .types import Section, Seed, safe_path_name


# The engine sets these LossConfig fields itself: temperature is rollout.temperature (the sampler's), and packing
# leaves no ignored targets.
_SET_BY_THE_ENGINE = ("temperature", "ignore_index")


def _loss_config_fields() -> dict[str, Any]:
    """The algorithm section's fields, taken from LossConfig: names, types, allowed values, defaults and
    descriptions are declared once, in ftis_kernels, and checked by LossConfig itself (see _loss_op_accepts)."""
    hints = typing.get_type_hints(LossConfig)
    fields: dict[str, Any] = {}
    for spec in dataclasses.fields(LossConfig):
        if spec.name in _SET_BY_THE_ENGINE:
            continue
        choices = spec.metadata.get("choices")
        annotation = Literal[choices] if choices else hints[spec.name]
        fields[spec.name] = (annotation, Field(spec.default, description=spec.metadata["help"]))
    return fields


_LossFields = create_model("_LossFields", __base__=Section, **_loss_config_fields())


class AlgorithmSettings(_LossFields):
    """The loss: every LossConfig option (docs/algorithm.md), plus how rewards become advantages."""

    scale_rewards: Literal["group", "none"] = Field("group", description="group: A = (r - mean) / (std + 1e-8); "
                                                    "none: A = r - mean (Dr. GRPO).")

    @model_validator(mode="after")
    def _loss_op_accepts(self) -> AlgorithmSettings:
        self.loss_config(temperature=1.0)  # LossConfig's own checks; its messages name the field
        return self

    def loss_config(self, temperature: float) -> LossConfig:
        fields = self.model_dump(exclude={"scale_rewards"})
        return LossConfig(**fields, temperature=temperature)


class RolloutSettings(Section):
    group_size: int = Field(12, ge=2, description="G: completions per prompt.")
    prompts_per_step: int = Field(24, ge=1, description="Prompts per step across the swarm (vertical: dealt "
                                  "round-robin).")
    max_new_tokens: int = Field(768, ge=1, description="Completion length limit in tokens.")
    temperature: float = Field(1.0, ge=0.01, le=100.0, allow_inf_nan=False,
                               description="Sampling temperature (the trainer divides logits by it).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; < 1 biases the IS ratios (warned).")
    top_k: int | None = Field(None, gt=0, description="Top-k sampling; set biases the IS ratios (warned).")
    generation_batch_size: int = Field(256, ge=1, description="Sequences per generate() call of the HF generator.")


class TrainSettings(Section):
    steps: int = Field(50, ge=1, description="Training steps (one update per member per step).")
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one packed forward/backward (prompt + completion tokens)."
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (under --nproc: each rank takes its local "
                        "GPU).")
    backend: Literal["auto", "triton", "torch"] = Field("auto", description="Fused-loss backend.")
    attn_implementation: Literal["auto", "flash_attention_2", "flex_attention", "varlen", "sdpa", "eager"] = Field(
        "auto",
        description="auto: on a GPU flash_attention_2 when installed, else varlen where torch has it, else sdpa; "
        "sdpa on the CPU. varlen (GPU, torch >= 2.10): torch's own FlashAttention-2 kernel "
        "(torch.nn.attention.varlen) on the packed row, no flash-attn package: 2.1x sdpa's update on an H100. "
        "flex_attention (GPU) skips the empty blocks of the packed row's block-diagonal mask that sdpa computes: "
        "1.03-1.13x varlen's update, after 3-4 minutes of compilation in the first one "
        "(benchmarks/results/update_step.json). Every member checks at start that packed sequences stay isolated.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (saves memory).")
    shared_prompt: bool = Field(True, description="A group's prompt computed once in the update (its completions "
                                "attend to one copy through a mask): the packed update's loss and gradients from "
                                "fewer tokens. Where the attention takes a mask (sdpa, eager: the CPU's); varlen and "
                                "flash_attention_2 keep the packed row. false: the packed row always.")
    layers: Literal["auto", "eager", "liger", "compile", "liger+compile"] = Field(
        "auto",
        description="How the decoder layers run in the update: eager (transformers' code); liger (Liger-Kernel's "
        "fused RMSNorm and SwiGLU; CUDA, pip install liger-kernel); compile (torch.compile of each decoder "
        "layer while autograd is on; generation stays eager: 1.23x eager's update on an H100, 13-36 s of "
        "compilation in the first); liger+compile (failed in torch 2.11's dynamo on an H100). auto: compile on a "
        "GPU, eager on the CPU.",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice); at most the "
                                "machine's cores.")
    epochs: int = Field(1, ge=1, le=100, description="Passes over each step's batch (GRPO's mu, TRL's num_iterations, "
                        "verl's ppo_epochs). Above 1 (or with mini_batches above 1) the batch's log-probs under the "
                        "step's starting policy are recorded before the first optimizer step and given to the loss "
                        "as old_logprobs, so the PPO clip (eps_low/eps_high), dual clip and delta act from the "
                        "second optimizer step on.")
    mini_batches: int = Field(1, ge=1, le=1000, description="Optimizer steps per pass: the batch is cut into this many "
                              "parts of whole groups (verl's ppo_mini_batch_size, as a count); each part's gradient "
                              "sums its micro-batches exactly.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="The learning rate over the run's steps after warm-up: constant, linear to lr / "
                                "(steps - warmup_steps) at the last step, or cosine to near 0. A pure function of the "
                                "step: a resume continues it exactly (a resume that extends train.steps stretches "
                                "what is left of a linear or cosine schedule).")
    warmup_steps: int = Field(0, ge=0, description="Steps over which the learning rate rises linearly from lr / "
                              "warmup_steps to lr (0: none).")

    @field_validator("device")
    @classmethod
    def _a_device_to_train_on(cls, value: str) -> str:
        if value != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ValueError(f"{value!r} is not a device to train on (auto, cpu, cuda or cuda:N)")
        return value


class EvalSettings(Section):
    every: int = Field(10, ge=0, description="Evaluate every N steps (0: only at step 0 and the end).")
    datasets: list[str] | None = Field(None, description="Eval datasets (default: the task's: gsm8k -> gsm8k, "
                                       "math500).")
    max_samples: int | None = Field(None, ge=1, description="Evaluate on the first N examples of each set (default: "
                                    "all).")
    max_new_tokens: int | None = Field(None, ge=1, description="Default: rollout.max_new_tokens.")
    batch_size: int = Field(256, ge=1, description="Prompts per greedy generate() call.")
    at_start: bool = Field(True, description="Evaluate at step 0 before training.")
    reward: str | None = Field(
        None, min_length=1,
        description="What eval counts as a right answer (greedy pass@1: the share of completions it gives 1 or "
                    "more), as 'module:function' (completion, gold) -> float, 1 right and 0 wrong. Default: the "
                    "task's own answer check (binary_answer_reward for gsm8k, math500, jsonl and hf; "
                    "final_answer_reward for gsm8k-calc; the built-in tasks' rewards), whatever data.reward or "
                    "data.rewards train on: set it when your answers take another form than the check expects.")
    payloads: list[Literal["inject", "in-context"]] | None = Field(
        None, description="Text attacks whose payload is looked for in every member's greedy eval completions (eval "
                          "records: attack_success, the share carrying any, and attack_success_by, per kind); "
                          "default: those of the run's adversaries (members.N.adversary). Set it to measure an "
                          "honest run's base rate (the in-context payload, a first column one too high, is also a "
                          "slip a model can make).")


class CheckpointSettings(Section):
    every: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep.")
    save_optimizer: bool = Field(True, description="Save optimizer state (needed for an exact --resume).")


class LoggingSettings(Section):
    completions: int = Field(
        0, ge=0, le=100, description="Sample completions written per member per step to completions.jsonl in the run "
                                     "directory (and TensorBoard text): prompt, completion, who made it, reward, "
                                     "advantage, its mean IS weight, KL and whether the filter dropped it, as the "
                                     "update saw them. 0: none.")
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=lambda: ["tensorboard"], description="Where the numbers go besides metrics.jsonl: "
        "tensorboard (run_dir/tensorboard), wandb, trackio (optional extras: pip install 'ftis-engine[wandb]' or "
        "'[trackio]'; offline as their own settings say: WANDB_MODE=offline, TRACKIO_DIR). [] : metrics.jsonl only.")
    project: str = Field("ftis-engine", min_length=1, description="The wandb / trackio project; the run is named "
                         "after run_name (and, async, its rank).")

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice: {value}")
        return value


class RunConfig(Section):
    run_name: str = Field("ftis-run", min_length=1, description="Run directory name under the output dir.")
    seed: Seed = Field(0, description="Seeds data order, model init of built-in models, sampling.")
    output_dir: str = Field("runs", description="Where run directories are created (overridden by --output-dir).")
    members: list[MemberSettings] = Field(..., min_length=1, description="The models that train together.")
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="The loss (docs/algorithm.md).")
    collaboration: Literal["vertical", "horizontal", "alone"] = Field(
        "vertical", description="vertical: a member generates a prompt's whole group; horizontal: groups split; alone."
    )
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Generation.")
    data: DataSettings = Field(default_factory=DataSettings, description="Task and data.")
    train: TrainSettings = Field(default_factory=TrainSettings, description="Update.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Evaluation.")
    swarm: SwarmSettings = Field(default_factory=SwarmSettings, description="Multi-process exchange.")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings, description="Checkpoints.")
    logging: LoggingSettings = Field(default_factory=LoggingSettings,
                                     description="What is logged for a person to read.")
    defense: DefenseSettings = Field(default_factory=DefenseSettings,
                                     description="A receiver's guards against dishonest peers, beyond its checks.")

    @field_validator("run_name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return safe_path_name(value)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        check_run(self)
        return self
