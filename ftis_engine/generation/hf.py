"""The transformers generator: `model.generate` on the member's own model (it shares the trainer's weights, so
`sync` has nothing to do; a member sharded over ranks samples from a plain replica that `sync` updates). Serves
CPU runs and tests.

Log-probs are the sampler's scores: generation runs with the model's own defaults disabled and our processor chain
(temperature, top-k, top-p) followed by a recorder, which reads the final processed scores of each step and,
on the next step, the log-prob of the token that was sampled from them. Memory: one [batch, V] tensor, not one per step.
"""

from __future__ import annotations

import contextlib

import torch
from ftis_kernels import NonFiniteInputError
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..model.fsdp import full
from ..model.precision import autocast
from . import Completion, SamplingSettings, cut_at_eos, eos_token_ids, warn_if_biased


class _SampledLogprobRecorder(LogitsProcessor):
    """Last processor of the chain: remembers log_softmax(scores) and gathers the sampled token's entry next step."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []
        self.nonfinite: torch.Tensor | None = None  # a row's scores held NaN or +inf (a diverged model)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.collect(input_ids[:, -1])
        # a diverged model's logits (NaN; +inf, or -inf for every token, from huge finite weights) would end in the
        # sampler's own error (multinomial's traceback on the CPU, a device-side assert on a GPU): such rows sample
        # from zeros instead and the caller raises once generation ends (one flag on the device, no sync per token)
        bad = (torch.isnan(scores) | torch.isposinf(scores)).any(dim=-1, keepdim=True) | \
            torch.isneginf(scores).all(dim=-1, keepdim=True)
        self.nonfinite = bad.any() if self.nonfinite is None else self.nonfinite | bad.any()
        scores = torch.where(bad, torch.zeros_like(scores), scores)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def collect(self, sampled: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(1, sampled[:, None]).squeeze(1))
            self.previous = None


class HFGenerator:
    """Sampling and greedy decoding with transformers, batched over prompts (left padding)."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 256, replica: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype  # the member's compute dtype: sampling runs in it, as the update does (autocast)
        self.batch_size = batch_size
        self.replica = replica  # a sharded member's plain copy (fsdp.py), synced from the shards
        self.push_seconds = 0.0  # nothing loads as it wakes (a replica copies in sync, which the step times)
        self.eos_ids = eos_token_ids(model, tokenizer)

    @torch.no_grad()
    def sync(self, model) -> None:
        """Nothing to push when generation reads the trainer's own parameters; a replica takes the trained
        parameters gathered from the shards, one at a time (every shard of the member calls this)."""
        if not self.replica:
            return
        mine = dict(self.model.named_parameters())
        for name, param in model.named_parameters():
            if param.requires_grad:
                mine[name].copy_(full(param.detach()))

    def awake(self) -> contextlib.AbstractContextManager[None]:
        """No separate engine: generation reads the trainer's parameters."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing held beyond the model, which the member owns."""

    def _clean_config(self, max_new_tokens: int, do_sample: bool) -> GenerationConfig:
        # A fresh config so that a model's shipped defaults (temperature 0.7, top_k 20, repetition penalty...)
        # can't alter the distribution we sample from and record.
        sampling = dict(temperature=1.0, top_p=1.0, top_k=0) if do_sample else {}
        return GenerationConfig(
            do_sample=do_sample, max_new_tokens=max_new_tokens, repetition_penalty=1.0,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=sorted(self.eos_ids), bos_token_id=None,
            use_cache=True, **sampling,
        )

    @contextlib.contextmanager
    def _without_model_defaults(self):
        """transformers fills every field our config leaves unset (min_p, typical_p, ...) from the model's own
        generation config, and such warpers would run after the log-prob recorder: swap in a blank one."""
        lm = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
        saved = lm.generation_config
        lm.generation_config = GenerationConfig(eos_token_id=sorted(self.eos_ids),
                                                pad_token_id=self.tokenizer.pad_token_id)
        try:
            yield
        finally:
            lm.generation_config = saved

    def _batches(self, prompts: list[list[int]]):
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            width = max(len(p) for p in chunk)
            pad = self.tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], dtype=torch.long, device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], dtype=torch.long,
                                device=self.device)
            yield ids, mask

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, on_batch=None) -> list[list[Completion]]:
        """n sampled completions for each prompt (token ids), each with the sampler's log-probs."""
        warn_if_biased(sampling.top_p, sampling.top_k, self.model.get_output_embeddings().weight.shape[0])
        repeated = [p for p in prompts for _ in range(sampling.n)]
        completions: list[Completion] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with self._eval_mode(), torch.random.fork_rng(devices=devices), self._without_model_defaults(), \
                autocast(self.device, self.dtype):
            torch.manual_seed(sampling.seed)
            for ids, mask in self._batches(repeated):
                recorder = _SampledLogprobRecorder()
                chain = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
                if sampling.top_k is not None:
                    chain.append(TopKLogitsWarper(top_k=sampling.top_k))
                if sampling.top_p < 1.0:
                    chain.append(TopPLogitsWarper(top_p=sampling.top_p))
                if sampling.min_new_tokens:  # part of the sampler: its claimed log-probs are of what it sampled from
                    chain.insert(0, MinNewTokensLengthLogitsProcessor(ids.shape[1], sampling.min_new_tokens,
                                                                      sorted(self.eos_ids), device=self.device))
                # every rank samples its own prompts on its own: transformers would otherwise keep an FSDP-managed
                # model stepping in lock-step with every rank of the world (synced_gpus, an all-reduce a token)
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask,
                    generation_config=self._clean_config(sampling.max_new_tokens, do_sample=True),
                    logits_processor=LogitsProcessorList(chain + [recorder]), synced_gpus=False,
                )
                if recorder.nonfinite is not None and bool(recorder.nonfinite):
                    raise NonFiniteInputError("its logits held NaN or +inf in generation")
                new_tokens = out[:, ids.shape[1] :]
                recorder.collect(new_tokens[:, -1])
                logprobs = torch.stack(recorder.logprobs, dim=1)
                for row in range(new_tokens.shape[0]):
                    completions.append(cut_at_eos(new_tokens[row].cpu(), logprobs[row].cpu(), self.eos_ids,
                                                  sampling.max_new_tokens))
                if on_batch is not None:
                    on_batch(ids.shape[0])
        return [completions[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int, on_batch=None) -> list[torch.Tensor]:
        """Greedy completions (token ids, cut after the first EOS) for evaluation."""
        outputs: list[torch.Tensor] = []
        with self._eval_mode(), autocast(self.device, self.dtype):
            for ids, mask in self._batches(prompts):
                with self._without_model_defaults():
                    out = self.model.generate(input_ids=ids, attention_mask=mask, synced_gpus=False,
                                              generation_config=self._clean_config(max_new_tokens, do_sample=False))
                for row in out[:, ids.shape[1] :].cpu():
                    done = cut_at_eos(row, torch.zeros(row.numel()), self.eos_ids, max_new_tokens)
                    outputs.append(done.token_ids)
                if on_batch is not None:
                    on_batch(ids.shape[0])
        return outputs

    @contextlib.contextmanager
    def _eval_mode(self):
        """Generation runs in eval mode; the model's mode is restored however generation ends (an exception in
        it must not leave the trainer's model in eval mode, with dropout off)."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)
