"""The vLLM generator: a `vllm.LLM` in the trainer's own process, on the member's GPU, sharing it with training.

- Engine: bf16, seeded, `enable_sleep_mode=True`, `gpu_memory_utilization` from the member's config, and
  `logprobs_mode="processed_logprobs"`, so the log-prob returned for each sampled token is the log-prob under the
  distribution actually sampled from (after temperature; with top_p = 1 and no top_k that is
  log_softmax(logits / T), the trainer's own quantity). Requires vLLM >= 0.10.2, where "processed" took that
  meaning.
- Seeds: one per request (prompt i of a call seeded s: `request_seed(s, i, n)`, a hash, and vLLM gives its j-th
  completion that + j; a completion does not depend on the batch), or with
  `vllm.per_request_seed: false` none, the device's default generator seeded from the step's seed for the call
  (vLLM draws a seeded request's noise on its own, one kernel per sequence and token; unseeded ones in one draw).
- Sleep (level 1 by default) while the trainer updates; wake before generating.
- Weight sync: `sync(model)` marks the weights stale; the next `wake_up()` wakes the weights only, pushes the
  trainer's parameters into the engine in place (`load_weights` on the engine's model, through `apply_model`),
  then wakes the KV cache and resets the prefix cache (cached prefixes were computed by the old weights).
  A LoRA member pushes only its adapter: saved in peft format and loaded as a new LoRARequest (the base
  weights in the engine never change, nothing is merged).
- In a single process the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the trainer can reach its
  model, on its member's GPU (`device_ids`, vLLM >= 0.24, where the member is not on cuda:0); under
  --nproc/torchrun it joins the ranks' torch.distributed world with the "external_launcher" executor (one engine
  per rank, tensor parallel 1), as TRL's colocate mode does.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
import time

import torch

from ..context import engine_length
from ..fsdp import full, is_sharded
from ..saving import save_pretrained
from . import Completion, SamplingSettings, eos_token_ids, warn_if_biased

log = logging.getLogger("ftis_engine.vllm")

INSTALL_HINT = "pip install ftis-engine[gpu]"
SUPPORTED = ">=0.10.2,<0.34"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM >= 0.11 turns on inductor's combo kernels under torch >= 2.9; with torch 2.11 their benchmarking fails an
# assertion (len(launchers) == 1) while compiling a Qwen2 (vLLM 0.24, H100): keep them off
COMPILATION_CONFIG = {"inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False}}


def check_available() -> str | None:
    """None when vLLM can run here, else the reason (with the install hint)."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({INSTALL_HINT})"
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    installed = version("vllm")
    if installed not in SpecifierSet(SUPPORTED):
        return f"vLLM {installed} is outside the supported range {SUPPORTED} ({INSTALL_HINT})"
    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is available (use generator: hf on CPU)"
    return None


def sampled_logprobs(output) -> list[float]:
    """The log-prob of each sampled token of a vLLM CompletionOutput (requested with logprobs=0): works for the
    list-of-dicts container and for FlatLogprobs, which indexes the same way."""
    values = []
    for position, token in enumerate(output.token_ids):
        entry = output.logprobs[position][token]
        values.append(float(entry.logprob))
    return values


def completions_from_vllm(request_output, eos_ids: set[int]) -> list[Completion]:
    """Completions (token ids, sampled-token log-probs, finish reason) of one vLLM RequestOutput."""
    completions = []
    for output in request_output.outputs:
        reason = output.finish_reason
        if reason in ("abort", "error") or reason is None:
            raise RuntimeError(f"vLLM did not finish a completion (finish_reason={reason!r})")
        ids = torch.tensor(list(output.token_ids), dtype=torch.int32)
        logprobs = torch.tensor(sampled_logprobs(output), dtype=torch.float32)
        if not bool(torch.isfinite(logprobs).all()):
            raise RuntimeError("vLLM returned a NaN or infinite log-prob for a sampled token")
        # processed log-probs are <= 0 up to float rounding; the exchange rejects positive values outright
        logprobs = logprobs.clamp(max=0.0)
        stopped = reason == "stop" and ids.numel() > 0 and int(ids[-1]) in eos_ids
        completions.append(Completion(ids, logprobs, "stop" if stopped else "length"))
    return completions


def checkpoint_names(model, state: dict) -> dict:
    """The state dict under the checkpoint's weight names, which vLLM's loaders expect: transformers >= 5 renames
    some families' weights on load (e.g. fused MoE experts); older versions keep the checkpoint's names."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)


def save_for_engine(model, tokenizer, directory: pathlib.Path) -> str:
    """Write a model's weights (in its dtype) and its tokenizer where an engine that loads from disk can read them
    (vLLM; also TRL's GRPOTrainer, benchmarks/trl_grpo.py); returns the directory as a string. A LoRA member's
    model (peft) is written as its base alone, under the base model's own names: peft's wrapped layers keep the
    base weight as `<layer>.base_layer.weight`, which no engine's loader knows; the adapter goes to the engine
    separately."""
    if hasattr(model, "peft_config"):
        base = model.get_base_model()
        state = {name.replace(".base_layer.", "."): tensor for name, tensor in base.state_dict().items()
                 if ".lora_" not in name}
        save_pretrained(base, directory, state_dict=state)
    else:
        save_pretrained(model, directory)
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def engine_source(model, tokenizer, settings, directory: pathlib.Path) -> str:
    """Where the engine loads the member's starting weights from: the packaged model's or hub's own files, unless
    the trainer's weights differ from them (a built-in model's random init, or a warm start: the engine would
    otherwise generate step 1's rollouts, and a LoRA member all of them, from weights the trainer does not hold),
    then the trainer's weights written to `directory`."""
    from ..models import source as model_source

    if settings.model.startswith("builtin:") or settings.warm_start is not None:
        return save_for_engine(model, tokenizer, directory)
    return model_source(settings.model)  # a packaged model's folder, or the hub id / local path as given


def request_seed(seed: int, request: int, n: int) -> int:
    """The seed of request `request` of a call seeded `seed` (vLLM seeds its j-th completion with it + j), in
    [0, 2^31 - n). A hash: two requests' n seeds meet only by chance (about 2n in 2^31 for any two). seed + i * n met
    the next step's once a member made 7,919 completions a step (schedule.mix_seed: consecutive steps' seeds are
    7,919 apart), and two calls of one step seeded alike met at once."""
    digest = hashlib.blake2b(f"{seed}/{request}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - n)


def _engine_takes(name: str) -> bool:
    """Whether the installed vLLM's engine arguments include `name`."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return name in {field.name for field in dataclasses.fields(EngineArgs)}


def _lora_rank(r: int) -> int:
    return next(x for x in LORA_RANKS if x >= r)


def _engine_weights(named: dict):
    """(name, tensor) pairs for the engine's loader, each gathered (a sharded tensor: a collective over its member's
    ranks) and floating ones cast to bf16 as it is taken."""
    for name, tensor in named.items():
        value = full(tensor.detach())
        yield name, (value.to(torch.bfloat16) if value.is_floating_point() else value)


@contextlib.contextmanager
def _seeded_rng(device: torch.device, seed: int):
    """For the block, `device`'s default random generator seeded with `seed` (the engine runs in this process and
    draws an unseeded request's noise from it); the CPU's and that device's generators are given back as they were
    after it (the trainer's own streams go on untouched). Only that one generator is seeded (torch.manual_seed would
    reset every GPU's)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index]):
            torch.cuda.default_generators[index].manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            yield


class VLLMGenerator:
    """Colocated vLLM engine for one member (see the module docstring)."""

    def __init__(self, model, tokenizer, device: torch.device, settings, config, seed: int):
        problem = check_available()
        if problem:
            raise RuntimeError(problem)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a dozen INFO lines per sleep/wake; read at import
        from vllm import LLM

        self.tokenizer = tokenizer
        self.settings = settings
        self.lora = settings.lora is not None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.sleep_level = settings.vllm.sleep_level
        self.per_request_seed = settings.vllm.per_request_seed
        self._device = device
        self._work = pathlib.Path(tempfile.mkdtemp(prefix=f"ftis-vllm-{settings.name}-"))
        try:  # no engine: nothing else would remove what was written for it
            self._start_engine(model, tokenizer, device, settings, config, seed, LLM)
        except BaseException:
            shutil.rmtree(self._work, ignore_errors=True)
            raise
        self._model = model
        self._gathered: dict[str, torch.Tensor] | None = None  # a sharded LoRA member's adapter, gathered at sync
        self._stale = self.lora  # a LoRA adapter exists only in the trainer until the first push
        self.push_seconds = 0.0  # seconds spent loading weights into the engine, all pushes together
        self._lora_request = None
        self._lora_version = 0
        self._asleep = False

    def _start_engine(self, model, tokenizer, device, settings, config, seed, LLM) -> None:
        """Write a built-in model's weights where vLLM can load them, and start the engine (self.llm)."""
        from ..models import source as model_source

        source = engine_source(model, tokenizer, settings, self._work / "base")
        # several ranks (--nproc/torchrun): join their world. A world of one is vLLM's own in-process group, left
        # initialised by an earlier engine of this process: a new engine runs on its own then too
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1)
        if not distributed:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the engine's model is reachable
        max_len = engine_length(config, settings)
        kwargs = dict(
            model=source, tokenizer=model_source(settings.tokenizer) if settings.tokenizer else source,
            dtype="bfloat16", seed=seed,
            gpu_memory_utilization=settings.vllm.gpu_memory_utilization, enable_sleep_mode=True,
            logprobs_mode="processed_logprobs", max_model_len=max_len, enforce_eager=settings.vllm.enforce_eager,
            enable_prefix_caching=True, tensor_parallel_size=1,
        )
        if not settings.vllm.enforce_eager:
            kwargs["compilation_config"] = copy.deepcopy(COMPILATION_CONFIG)
        if distributed:
            # vLLM builds its groups over the ranks' world (vllm/distributed/parallel_state.py, 0.24: the world group
            # spans every rank; with TP = PP = 1 every compute group is a group of one) and its external launcher
            # puts the engine on cuda:LOCAL_RANK, which under --nproc is the process's local rank: for members that
            # share a GPU (members.N.device) that is another GPU, or none. The engine goes where its member is.
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ["RANK"] = str(torch.distributed.get_rank())
            os.environ["LOCAL_RANK"] = str(device.index if device.index is not None else 0)
        elif device.type == "cuda" and (device.index or 0) != 0:
            # in-process, vLLM derives the engine's GPU from its device config, which carries no index (0.24:
            # UniProcExecutor._distributed_args), so the engine would run on cuda:0 beside a member on cuda:N;
            # device_ids maps its local rank 0 to the member's GPU (indices into CUDA_VISIBLE_DEVICES, as torch's)
            if not _engine_takes("device_ids"):
                from ..config import ConfigError

                index = next(i for i, m in enumerate(config.members) if m is settings)
                raise ConfigError(f"members.{index}.device: this vLLM runs an in-process engine on cuda:0 only, "
                                  f"not on the member's {device}; run with CUDA_VISIBLE_DEVICES={device.index} "
                                  "(the member then on cuda:0), or one process per member (--nproc), or vLLM >= 0.24")
            kwargs["device_ids"] = [device.index]
        if self.lora:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(settings.lora.r))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.llm = LLM(**kwargs)  # vLLM seeds the process-wide RNGs; keep the trainer's streams as they were

    # ------------------------------------------------------------------------------------------- lifecycle

    def sync(self, model) -> None:
        """The trainer's weights changed: push them now if the engine is awake, else at the next wake_up. A member
        sharded over ranks (fsdp.py) gathers each tensor while the engine's loader takes it (every shard
        pushes at the same point: sync and wake_up are called on all of them together), so no rank ever holds a
        host copy of the model; a LoRA adapter is small and gathered here, onto the CPU."""
        self._model = model
        self._stale = True
        if self.lora and any(is_sharded(p) for p in model.parameters()):
            self._gathered = {n: full(p.detach()).cpu() for n, p in model.named_parameters() if p.requires_grad}
        if not self._asleep:
            self._push()

    def sleep(self) -> None:
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            # what the update left in torch's cache goes back to the device first (as TRL does): the engine maps
            # its weights and KV cache outside torch's allocator, and on a shared GPU another member's engine
            # wakes beside this process's cache
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            if self.sleep_level == 2:
                self._stale = True  # level 2 discarded the weights: they must be loaded again
            if self._stale:
                self._push()
            self.llm.wake_up(tags=["kv_cache"])
            sleeping = getattr(self.llm.llm_engine, "is_sleeping", None)
            if sleeping is None or sleeping():  # anything else (scheduling) that a version of vLLM still holds
                self.llm.wake_up()
            self._asleep = False
        elif self._stale:
            self._push()

    @contextlib.contextmanager
    def awake(self):
        """Engine weights and KV cache on the GPU for the block; asleep (level members.N.vllm.sleep_level) after,
        so that the update has the memory."""
        self.wake_up()
        try:
            yield
        finally:
            self.sleep()

    def _push(self) -> None:
        start = time.perf_counter()
        if self.lora:
            self._push_adapter()
        else:
            # float32 masters go to the engine in its dtype (bf16), streamed: one tensor gathered (a sharded
            # member's, on every shard at once) and cast at a time as the loader takes it (it takes any iterable),
            # never a second copy of the whole model, on the GPU or the host
            named = checkpoint_names(self._model, self._model.state_dict())
            self.llm.apply_model(lambda engine_model: engine_model.load_weights(_engine_weights(named)))
        self.llm.reset_prefix_cache()
        self._stale = False
        self.push_seconds += time.perf_counter() - start  # the step reports it as sync_seconds

    def _push_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        self._lora_version += 1
        path = self._work / f"adapter-{self._lora_version}"
        save_pretrained(self._model, path, **({"state_dict": self._gathered} if self._gathered else {}))
        if self._lora_request is not None:
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        # a fresh id per version: vLLM caches adapters by id and would otherwise keep serving the old one
        self._lora_request = LoRARequest(f"{self.settings.name}-v{self._lora_version}", self._lora_version, str(path))

    # ------------------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, on_batch=None) -> list[list[Completion]]:
        from vllm import SamplingParams

        warn_if_biased(sampling.top_p, sampling.top_k, self._model.get_output_embeddings().weight.shape[0])
        self.wake_up()
        params = []
        for i in range(len(prompts)):
            extra = {"top_k": sampling.top_k} if sampling.top_k is not None else {}
            seed = request_seed(sampling.seed, i, sampling.n) if self.per_request_seed else None
            params.append(SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                         max_tokens=sampling.max_new_tokens, min_tokens=sampling.min_new_tokens,
                                         logprobs=0, seed=seed, **extra))
        with contextlib.nullcontext() if self.per_request_seed else _seeded_rng(self._device, sampling.seed):
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                        lora_request=self._lora_request)
        if on_batch is not None:
            on_batch(len(prompts) * sampling.n)
        return [completions_from_vllm(out, self.eos_ids) for out in outputs]

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, on_batch=None) -> list[torch.Tensor]:
        from vllm import SamplingParams

        self.wake_up()
        params = SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                    lora_request=self._lora_request)
        if on_batch is not None:
            on_batch(len(prompts))
        return [torch.tensor(list(out.outputs[0].token_ids), dtype=torch.int32) for out in outputs]

    def close(self) -> None:
        """Shut the engine down and delete the temporary weights and adapters it was loaded from."""
        llm, self.llm = self.llm, None
        if llm is not None:
            # where the engine has a shutdown (not vLLM 0.24, whose LLMEngine lacks one: its memory goes with the
            # process, which was all that ran on the GPU), call it so that the GPU memory is released now
            shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
        shutil.rmtree(self._work, ignore_errors=True)
