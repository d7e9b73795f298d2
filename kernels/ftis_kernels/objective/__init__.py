"""The objective on per-token log-probs, in four stages, each a small function of [N] / [S] tensors that both
backends share (the loss depends on the logits only through l_t, so autograd through them gives dL/dl_t, which the
backward vocabulary pass turns into the gradient of the logits, or of hidden, weight and bias):

    prepare (prepare.py)  ->  policy term by method (terms.py, POLICY_TERMS)  ->  aggregate by normalisation
    (aggregate.py)  ->  stats (stats.py)

`ftis_kernels.epilogue.ftis_objective` runs them on one call's inputs.
"""

from .aggregate import aggregate, with_regularisers
from .prepare import Prepared, prepare
from .stats import statistics
from .terms import POLICY_TERMS, PolicyTerm

__all__ = ["POLICY_TERMS", "PolicyTerm", "Prepared", "aggregate", "prepare", "statistics", "with_regularisers"]
