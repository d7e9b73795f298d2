"""vLLM generator (placeholder until the vLLM issue): reports that it is unavailable."""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install ftis-engine[gpu]"


def check_available() -> str | None:
    """None when vLLM can run here, else the reason (with the install hint)."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({INSTALL_HINT})"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is available (use generator: hf on CPU)"
    return None
