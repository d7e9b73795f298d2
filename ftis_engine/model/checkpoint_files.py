"""A checkpoint's member folder checked whole before anything of it is used (checkpoint.restore_member): it holds
the kind of model the member's config trains (a full model: config.json and model.safetensors of its architecture;
a LoRA adapter: adapter_config.json and adapter_model.safetensors), every tensor of its shape and dtype (read from
the files' headers, before a byte of weights is loaded), nothing extra, and every tensor finite (weights and
optimizer state, as they are loaded). All of it local: a folder of another member, another kind or another size is
one CheckpointFault naming the tensor and its file, never a library's load report or a trip to the hub.
"""

from __future__ import annotations

import json
import pathlib

import torch

from ..core.safefile import read_bytes

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
# safetensors' names of the dtypes a member keeps its weights in (what save_pretrained writes for each)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


MAX_JSON_BYTES = 16 << 20  # a checkpoint's JSON files (state.json, a receiver's kept state) are kilobytes


def read_small_json(path: pathlib.Path, limit: int = MAX_JSON_BYTES) -> object:
    """A checkpoint's JSON file, its size bounded before it is read whole (safefile.read_bytes): OSError when it is
    missing, not a regular file or over `limit` bytes (safefile.TooLarge), ValueError when it is not JSON."""
    return json.loads(read_bytes(path, limit, "a checkpoint's JSON file"))


class CheckpointFault(ValueError):
    """A checkpoint whose files are there but do not hold what this member saved (another kind or architecture, a
    tensor missing, extra, of another shape or dtype, NaN or inf): the checkpoint's fault, named as its file's."""


def who(member) -> str:
    return f"members.{member.index} ({member.name})"


def check_kind(member, model_dir: pathlib.Path) -> None:
    """The folder holds the kind of model the member's config trains, with the files it needs (a folder swapped
    with another member's, or an adapter where a full model goes, is said as such)."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is missing")
    adapter = (model_dir / ADAPTER_FILE).exists() or (model_dir / ADAPTER_CONFIG).exists()
    full = (model_dir / MODEL_CONFIG).exists() or bool(model_weight_files(model_dir))
    lora = member.settings.lora is not None
    if lora and full and not adapter:
        raise CheckpointFault(f"{model_dir}: holds a full model ({MODEL_CONFIG}, model weights), but {who(member)} "
                              f"trains a LoRA adapter (members.{member.index}.lora): another member's folder?")
    if not lora and adapter and not full:
        raise CheckpointFault(f"{model_dir}: holds a LoRA adapter ({ADAPTER_FILE}), but {who(member)} is a full "
                              f"model (members.{member.index}.lora is null): another member's folder?")
    for name in (ADAPTER_CONFIG, ADAPTER_FILE) if lora else (MODEL_CONFIG,):
        if not (model_dir / name).is_file():
            raise CheckpointFault(f"{model_dir / name} is missing ({who(member)}'s checkpoint needs it)")
    if lora:
        return
    if not model_weight_files(model_dir):
        raise CheckpointFault(f"{model_dir}: holds no model.safetensors ({who(member)}'s weights)")
    saved = read_small_json(model_dir / MODEL_CONFIG)  # bounded; not JSON: a ValueError, the file's
    own = member.causal_lm.config.model_type
    if not isinstance(saved, dict) or saved.get("model_type") != own:
        kind = saved.get("model_type") if isinstance(saved, dict) else None
        raise CheckpointFault(f"{model_dir / MODEL_CONFIG}: describes a {kind!r} model, but {who(member)} is a "
                              f"{own!r} model: another member's or model's folder?")


def model_weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """A full model's weight files (model.safetensors, or its shards): every .safetensors but an adapter's."""
    return sorted(p for p in model_dir.glob("*.safetensors") if p.name != ADAPTER_FILE)


def read_headers(files: list[pathlib.Path]) -> dict[str, tuple[tuple[int, ...], str, pathlib.Path]]:
    """name -> (shape, safetensors dtype, file) of every tensor in `files`, from their headers alone."""
    from safetensors import safe_open

    found = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                found[name] = (tuple(part.get_shape()), part.get_dtype(), file)
    return found


def check_tensors(member, found: dict, expected: dict[str, torch.Tensor], exact: bool, where: pathlib.Path) -> None:
    """The saved tensors (read_headers) against the member's own (`expected`, name -> tensor): the shape and dtype
    of each one both have, and with `exact` the same names (a full model's saved names may differ from its module's
    where transformers converts them on load: there the loader says what is missing)."""
    if exact:
        missing = [name for name in expected if name not in found]
        extra = [name for name in found if name not in expected]
        if missing or extra:
            raise CheckpointFault(f"{where} does not fit {who(member)}'s adapter ({len(missing)} of its weights "
                                  f"missing, e.g. {missing[:1]}; {len(extra)} unexpected, e.g. {extra[:1]}): "
                                  "another member's or model's adapter?")
    for name, (shape, dtype, file) in found.items():
        own = expected.get(name)
        if own is None:
            continue
        if shape != tuple(own.shape):
            raise CheckpointFault(f"{file}: tensor {name} has shape {list(shape)}, {who(member)}'s has "
                                  f"{list(own.shape)}: another member's or model's checkpoint?")
        if dtype != SAFETENSORS_DTYPES.get(own.dtype, dtype):
            raise CheckpointFault(f"{file}: tensor {name} is {dtype}, {who(member)} keeps it in "
                                  f"{SAFETENSORS_DTYPES[own.dtype]} (a checkpoint keeps the master weights)")


def check_loaded(member, info: dict, model_dir: pathlib.Path) -> None:
    """What transformers' loader found (output_loading_info) where the saved names were converted: a tensor the
    model has that the files lack (the loader would leave it at a random init), one it does not know, or one of
    another shape."""
    for key, what in (("missing_keys", "lacks"), ("unexpected_keys", "holds an unknown"),
                      ("mismatched_keys", "holds another shape of")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointFault(f"{model_dir}: {what} tensor {names[0]}{more} of {who(member)}'s model")


def check_finite(tensors, file_of) -> None:
    """Every (name, tensor) of `tensors` finite; file_of(name) is the file it was read from."""
    for name, tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise CheckpointFault(f"{file_of(name)}: tensor {name} holds NaN or inf (the checkpoint is damaged; "
                                  "a run never saves non-finite weights)")


def check_optimizer_state(state, optimizer: torch.optim.Optimizer | None, file: pathlib.Path) -> None:
    """An optimizer state read from `file`: every moment finite, and (optimizer given: a member on one rank, whose
    parameters are whole) of its parameter's shape. Its form is load_state_dict's to check."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    for key, entry in state["state"].items():
        if not isinstance(entry, dict):
            continue
        param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            check_finite([(f"{name} of parameter {key}", value)], lambda _: file)
            if param is not None and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                raise CheckpointFault(f"{file}: {name} of parameter {key} has shape {list(value.shape)}, the "
                                      f"parameter {list(param.shape)}: another member's or model's optimizer state?")
