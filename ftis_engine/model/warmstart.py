"""Warm start: a short supervised phase on a task's worked demonstrations, so that RL begins from a partly able
policy, as the paper's pretrained Qwen models do. Deterministic from its settings and the model's init seed;
computed once and cached (`FTIS_CACHE_DIR`, default ~/.cache/ftis-engine), so every run of a study that starts
from the same member loads the same weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import pickle

import torch

from ..config import ConfigError
from ..core import safefile
from ..data.tasks import prompt_ids
from .precision import autocast, make_optimizer

log = logging.getLogger("ftis_engine")

# Bump when the supervised phase or the demonstrations change: cached weights of an older version are not reused.
VERSION = 1


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FTIS_CACHE_DIR") or pathlib.Path.home() / ".cache" / "ftis-engine") / "warm-start"


def cache_key(model_spec: str, init_seed: int, task_name: str, settings, dtype: torch.dtype, vocab_size: int,
              master: torch.dtype | None = None) -> str:
    identity = {"version": VERSION, "model": model_spec, "init_seed": init_seed, "task": task_name,
                "vocab_size": vocab_size, "dtype": str(dtype), **settings.model_dump(mode="json")}
    if master is not None:  # float32 masters keep the keys (and cache entries) they always had
        identity["master_dtype"] = str(master)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """One process computes a cache entry; the others wait for it (flock, released by the OS on any exit). A cache
    directory that cannot be made or written (FTIS_CACHE_DIR a file, a read-only place) is one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = safefile.open_lock(path)  # never through a link planted at its name
    except OSError as exc:
        named = f"{exc.filename}: " if isinstance(exc, safefile.LinkRefused) else ""
        # from None: a one-line error for the user; the cause adds nothing to it
        raise ConfigError(f"FTIS_CACHE_DIR: cannot keep warm starts in {path.parent} ({named}{exc.strerror or exc}); "
                          "point it at a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def warm_start(model: torch.nn.Module, tokenizer, task, settings, model_spec: str, init_seed: int,
               device: torch.device, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    """Load the cached warm-started weights into `model` (float32 masters), computing them first if no run has yet:
    forward and backward in the compute `dtype`, as the RL updates run. `settings` is a WarmStartSettings. Returns
    the cache file."""
    master = next(model.parameters()).dtype  # bf16 masters step otherwise (stochastic rounding): another entry
    key = cache_key(model_spec, init_seed, task.name, settings, dtype, len(tokenizer),
                    master=None if master == torch.float32 else master)
    path = cache_dir() / f"{key}.pt"
    with _locked(path.with_suffix(".lock")):
        state = _read(path, device, max_cache_bytes(model))
        if state is None:
            state = supervised_phase(model, tokenizer, task, settings, init_seed, device, dtype)
            try:  # whole or none (readers see a whole file), never through a link
                with safefile.open_write(path) as out:
                    torch.save(state, out)
            except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
                reason = getattr(exc, "strerror", None) or " ".join(str(exc).split())[:120]
                # from None: a one-line error for the user; the cause adds nothing to it
                raise ConfigError(f"FTIS_CACHE_DIR: cannot write {path} ({reason})") from None
    model.load_state_dict(state)
    return path


# What torch.load(weights_only=True) raises for a damaged file: RuntimeError (a truncated archive), EOFError (an empty
# file), UnpicklingError (a pickle that would run code, or no pickle at all), ValueError, OSError (unreadable).
_DAMAGED = (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError)


def max_cache_bytes(model: torch.nn.Module) -> int:
    """The most a cache entry of `model` may hold: twice its weights' bytes and 16 MiB (torch.save's archive adds
    kilobytes); a file larger than that is no entry of this model's, and is not read."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return 2 * weights + (16 << 20)


def _read(path: pathlib.Path, device: torch.device, limit: int) -> dict | None:
    """A cached warm start, or None when there is none or it is broken (truncated, over `limit` bytes, not a plain
    state dict, or one that would run code when loaded): a broken one is said and rebuilt, never fatal to every
    later run."""
    if not path.is_file():
        return None
    try:
        with safefile.open_bounded(path, limit, "a warm-start cache entry") as handle:  # its size checked first
            state = torch.load(handle, map_location=device, weights_only=True)
        if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
            return state
        problem = "not a state dict of tensors"
    except _DAMAGED as exc:
        problem = f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
    log.warning("warm start cache entry %s cannot be used (%s): computing it again", path, problem)
    return None


def supervised_phase(model: torch.nn.Module, tokenizer, task, settings, init_seed: int,
                     device: torch.device, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Next-token cross-entropy on the completion tokens (and end of text) of `settings.steps` batches of
    demonstrations in `settings.style`, with Adam. Returns the weights (CPU)."""
    seed = settings.seed if settings.seed is not None else init_seed
    pairs = task.demonstrations(settings.style, settings.steps * settings.batch_size, seed)
    eos = tokenizer.eos_token_id
    master = next(model.parameters()).dtype  # bf16 masters step with stochastic rounding, as in the RL updates
    optimizer = make_optimizer(list(model.parameters()), "adam", settings.lr, (0.9, 0.999), 0.0, master)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(pairs), settings.batch_size):
            rows, labels = [], []
            for question, completion in pairs[start : start + settings.batch_size]:
                prompt = prompt_ids(tokenizer, task, question)
                answer = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
                rows.append(prompt + answer)
                labels.append([-100] * len(prompt) + answer)
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows], device=device)
            target = torch.tensor([t + [-100] * (width - len(t)) for t in labels], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
            with autocast(device, dtype):
                loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    model.eval()
    return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
