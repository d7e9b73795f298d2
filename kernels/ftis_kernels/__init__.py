"""ftis_kernels: the fused F-TIS loss as a standalone torch function (imports only torch, and triton on demand).

    from ftis_kernels import fused_linear_ftis_loss, LossConfig
    out = fused_linear_ftis_loss(hidden, lm_head.weight, targets, gen_logprobs, advantages, cu_seqlens)
    out.loss.backward()

A name is loaded on first use (PEP 562): LossConfig and the option tuples come from options.py, which imports no
torch (the run config needs them and nothing else); the op's names load api.py and torch.

See the README (The fused loss op) for the contract and docs/algorithm.md for the formulas (kernels/ftis_kernels/objective/).
"""

from importlib import import_module as _import_module
from importlib.util import find_spec as _find_spec

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "FTISLoss",
    "FusedLinearFTISLoss",
    "KL_ESTIMATORS",
    "KL_REDUCTIONS",
    "LossConfig",
    "LossInputs",
    "LossOutput",
    "NonFiniteInputError",
    "combine_stats",
    "rejection_scale",
    "METHODS",
    "NORMALIZATIONS",
    "STAT_KEYS",
    "ftis_loss",
    "fused_linear_ftis_loss",
    "fused_linear_token_logprobs",
    "group_advantages",
    "resolve_backend",
    "token_logprobs",
]

# where each public name is defined
_HOMES = {
    **dict.fromkeys(("BACKENDS", "FTISLoss", "FusedLinearFTISLoss", "ftis_loss", "fused_linear_ftis_loss",
                     "fused_linear_token_logprobs", "resolve_backend", "token_logprobs"), "api"),
    **dict.fromkeys(("KL_ESTIMATORS", "KL_REDUCTIONS", "METHODS", "NORMALIZATIONS", "STAT_KEYS", "LossConfig"),
                    "options"),
    **dict.fromkeys(("LossInputs", "LossOutput", "NonFiniteInputError", "combine_stats", "rejection_scale"), "config"),
    "group_advantages": "advantages",
}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        value = getattr(_import_module(f".{_HOMES[name]}", __name__), name)
        globals()[name] = value  # looked up once: later reads are plain attribute reads
        return value
    # a submodule read as an attribute (ftis_kernels.api), as when this file imported them all
    if name.isidentifier() and not name.startswith("_") and _find_spec(f"{__name__}.{name}") is not None:
        return _import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
