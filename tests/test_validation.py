"""Every bad input of the op (README, The fused loss op) raises ValueError / TypeError naming the argument."""

from __future__ import annotations

import pytest
import torch

import ftis_kernels
from ftis_kernels import LossConfig

from .problems import make_problem


def _args(problem):
    return dict(
        hidden=problem.hidden.float(), weight=problem.weight.float(), targets=problem.targets, gen_logprobs=problem.gen,
        advantages=problem.adv, cu_seqlens=problem.cu,
    )


def _call(**changes):
    problem = make_problem(seed=1)
    args = _args(problem)
    kwargs = {k: changes.pop(k) for k in list(changes) if k in ("bias", "old_logprobs", "group_ids", "config", "backend")}
    args.update(changes)
    return ftis_kernels.fused_linear_ftis_loss(
        args.pop("hidden"), args.pop("weight"), args.pop("targets"), args.pop("gen_logprobs"),
        args.pop("advantages"), args.pop("cu_seqlens"), **kwargs,
    )


def _n():
    return int(make_problem(seed=1).cu[-1])


BAD = {
    "hidden 1-D": (dict(hidden=torch.randn(5)), ValueError, "hidden"),
    "hidden int": (dict(hidden=torch.ones(3, 4, dtype=torch.int64)), TypeError, "hidden"),
    "hidden fp64 on triton": (dict(hidden=torch.randn(3, 24, dtype=torch.float64), backend="triton"), TypeError, "hidden"),
    "weight d mismatch": (dict(weight=torch.randn(75, 7)), ValueError, "weight"),
    "weight dtype": (dict(weight=torch.randn(75, 24, dtype=torch.bfloat16)), TypeError, "weight"),
    "bias shape": (dict(bias=torch.randn(74)), ValueError, "bias"),
    "bias dtype": (dict(bias=torch.randn(75, dtype=torch.float16)), TypeError, "bias"),
    "targets float": (dict(targets=torch.zeros(_n())), TypeError, "targets"),
    "targets length": (dict(targets=torch.zeros(3, dtype=torch.long)), ValueError, "targets"),
    "targets >= V": (dict(targets=torch.full((_n(),), 75)), ValueError, "targets"),
    "targets negative": (dict(targets=torch.full((_n(),), -1)), ValueError, "targets"),
    "gen nan": (dict(gen_logprobs=torch.full((_n(),), float("nan"))), ValueError, "gen_logprobs"),
    "gen inf": (dict(gen_logprobs=torch.full((_n(),), -float("inf"))), ValueError, "gen_logprobs"),
    "gen positive": (dict(gen_logprobs=torch.full((_n(),), 0.5)), ValueError, "gen_logprobs"),
    "gen length": (dict(gen_logprobs=torch.zeros(2)), ValueError, "gen_logprobs"),
    "gen int": (dict(gen_logprobs=torch.zeros(_n(), dtype=torch.long)), TypeError, "gen_logprobs"),
    "old nan": (dict(old_logprobs=torch.full((_n(),), float("nan"))), ValueError, "old_logprobs"),
    "old length": (dict(old_logprobs=torch.zeros(3)), ValueError, "old_logprobs"),
    "advantages length": (dict(advantages=torch.zeros(2)), ValueError, "advantages"),
    "advantages nan": (dict(advantages=torch.full((6,), float("nan"))), ValueError, "advantages"),
    "cu_seqlens not from 0": (dict(cu_seqlens=torch.tensor([1, 2, 3, 4, 5, 6, _n()], dtype=torch.int32)), ValueError,
                              "cu_seqlens"),
    "cu_seqlens not to N": (dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.int32)), ValueError,
                            "cu_seqlens"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 3, 2, 4, 5, 6, _n()], dtype=torch.int32)), ValueError,
                              "cu_seqlens"),
    "cu_seqlens float": (dict(cu_seqlens=torch.zeros(7)), TypeError, "cu_seqlens"),
    "cu_seqlens 2-D": (dict(cu_seqlens=torch.zeros(1, 7, dtype=torch.int32)), ValueError, "cu_seqlens"),
    "group_ids length": (dict(group_ids=torch.zeros(3, dtype=torch.long)), ValueError, "group_ids"),
    "config type": (dict(config={"method": "tis"}), TypeError, "config"),
    "unknown backend": (dict(backend="cuda"), ValueError, "backend"),
    "triton on cpu without interpreter": (dict(backend="triton"), None, None),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_raises_naming_the_argument(case, monkeypatch):
    changes, error, name = BAD[case]
    if error is None:
        monkeypatch.delenv("TRITON_INTERPRET")
        error, name = ValueError, "backend"
    with pytest.raises(error, match=name):
        _call(**changes)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(method="ppo"), "method"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(kl_reduction="max"), "kl_reduction"),
        (dict(normalization="batch"), "normalization"),
        (dict(is_cap=0.0), "is_cap"),
        (dict(is_cap=float("nan")), "is_cap"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(temperature=0.0), "temperature"),
        (dict(kl_threshold="high"), "kl_threshold"),
        (dict(kl_reduction="padded_mean"), "kl_max_len"),
        (dict(normalization="constant"), "norm_max_len"),
        (dict(normalization="constant", norm_max_len=0), "norm_max_len"),
        (dict(ignore_index=1.5), "ignore_index"),
    ],
)
def test_bad_config_raises_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**options)


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match="kl_treshold"):
        ftis_kernels.ftis_loss(
            torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.zeros(1),
            torch.tensor([0, 2], dtype=torch.int32), kl_treshold=3.0,
        )


def test_logits_entry_point_validates_too():
    with pytest.raises(TypeError, match="logits"):
        ftis_kernels.ftis_loss(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.long),
                               torch.zeros(2), torch.zeros(1), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="targets"):
        ftis_kernels.token_logprobs(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="temperature"):
        ftis_kernels.token_logprobs(torch.zeros(2, 3), torch.tensor([0, 2]), temperature=-1.0)


def test_ignore_index_is_allowed_but_no_other_out_of_range_id():
    out = ftis_kernels.ftis_loss(torch.zeros(2, 3), torch.tensor([-100, 1]), torch.zeros(2), torch.zeros(1),
                                 torch.tensor([0, 2], dtype=torch.int32), backend="torch")
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="targets"):
        ftis_kernels.ftis_loss(torch.zeros(2, 3), torch.tensor([-99, 1]), torch.zeros(2), torch.zeros(1),
                               torch.tensor([0, 2], dtype=torch.int32), backend="torch")
