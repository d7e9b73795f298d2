"""Writing a transformers model to a folder from any rank of a torch world (checkpoints, a vLLM engine's weights,
converted packaged models)."""

from __future__ import annotations

import pathlib


def save_pretrained(model, directory: pathlib.Path | str, **kwargs) -> None:
    """`model.save_pretrained(directory, **kwargs)` written by this process whatever its rank in the torch world.
    transformers 5 writes a model's files on the world's rank 0 alone (PreTrainedModel.should_save_on_this_rank)
    and returns without a word on the others, but here a member's leader writes its own checkpoint and engine
    weights, and under --nproc member 1's leader is rank 1: its checkpoints held no weights and its vLLM engine
    found no config.json. Raises when no weights file came out."""
    override = hasattr(model, "should_save_on_this_rank")
    if override:  # an instance attribute for the call's length, over the class's method
        model.should_save_on_this_rank = lambda is_main_process=True: True
    try:
        model.save_pretrained(str(directory), **kwargs)
    finally:
        if override:
            del model.should_save_on_this_rank
    if not any(pathlib.Path(directory).glob("*.safetensors")) and not any(pathlib.Path(directory).glob("*.bin")):
        raise RuntimeError(f"{directory}: save_pretrained wrote no weights file")
