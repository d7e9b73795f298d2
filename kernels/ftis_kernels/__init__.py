"""ftis_kernels: the fused F-TIS loss as a standalone torch function (imports only torch, and triton on demand).

    from ftis_kernels import fused_linear_ftis_loss, LossConfig
    out = fused_linear_ftis_loss(hidden, lm_head.weight, targets, gen_logprobs, advantages, cu_seqlens)
    out.loss.backward()

See the README (The fused loss op) for the contract and docs/algorithm.md for the formulas (kernels/ftis_kernels/objective/).
"""

from .api import (
    BACKENDS,
    FTISLoss,
    FusedLinearFTISLoss,
    ftis_loss,
    fused_linear_ftis_loss,
    fused_linear_token_logprobs,
    resolve_backend,
    token_logprobs,
)
from .config import KL_ESTIMATORS, KL_REDUCTIONS, METHODS, NORMALIZATIONS, STAT_KEYS, LossConfig, LossInputs, LossOutput, NonFiniteInputError, combine_stats, rejection_scale
from .advantages import group_advantages

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
