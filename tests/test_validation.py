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
    keywords = ("bias", "old_logprobs", "group_ids", "config", "backend", "num_sequences", "num_tokens")
    kwargs = {k: changes.pop(k) for k in list(changes) if k in keywords}
    args.update(changes)
    return ftis_kernels.fused_linear_ftis_loss(
        args.pop("hidden"), args.pop("weight"), args.pop("targets"), args.pop("gen_logprobs"),
        args.pop("advantages"), args.pop("cu_seqlens"), **kwargs,
    )


def _n():
    return int(make_problem(seed=1).cu[-1])


def _with(t: torch.Tensor, row: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[row, 0] = value
    return t


BAD = {
    "hidden 1-D": (dict(hidden=torch.randn(5)), ValueError, "hidden"),
    "hidden int": (dict(hidden=torch.ones(3, 4, dtype=torch.int64)), TypeError, "hidden"),
    "hidden fp64 on triton": (dict(hidden=torch.randn(3, 24, dtype=torch.float64), backend="triton"), TypeError, "hidden"),
    "weight d mismatch": (dict(weight=torch.randn(75, 7)), ValueError, "weight"),
    "weight dtype": (dict(weight=torch.randn(75, 24, dtype=torch.bfloat16)), TypeError, "weight"),
    "bias shape": (dict(bias=torch.randn(74)), ValueError, "bias"),
    "bias dtype": (dict(bias=torch.randn(75, dtype=torch.float16)), TypeError, "bias"),
    "targets float": (dict(targets=torch.zeros(_n())), TypeError, "targets"),
    "targets uint8": (dict(targets=torch.zeros(_n(), dtype=torch.uint8)), TypeError, "targets: expected a signed"),
    "hidden nan": (dict(hidden=_with(make_problem(seed=1).hidden.float(), 4, float("nan"))), ValueError,
                   r"hidden, weight or bias: contains NaN or inf \(it reaches row 4 of hidden"),
    "weight inf": (dict(weight=_with(make_problem(seed=1).weight.float(), 7, float("inf"))), ValueError,
                   "hidden, weight or bias: contains NaN or inf"),
    "bias nan": (dict(bias=torch.full((75,), float("nan"))), ValueError, "hidden, weight or bias: contains NaN"),
    "num_sequences below the call's": (dict(num_sequences=5), ValueError, "num_sequences: must be an int >= this "
                                                                         "call's 6 sequences"),
    "num_sequences bool": (dict(num_sequences=True), ValueError, "num_sequences"),
    "num_sequences float": (dict(num_sequences=6.0), ValueError, "num_sequences"),
    "num_tokens zero": (dict(num_tokens=0), ValueError, "num_tokens: must be an int >= this call's"),
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
    "cu_seqlens empty sequence": (dict(cu_seqlens=torch.tensor([0, 1, 3, 3, 5, 6, _n()], dtype=torch.int32)),
                                  ValueError, r"cu_seqlens\[3\]=3 <= cu_seqlens\[2\]=3"),
    "cu_seqlens only [0]": (dict(cu_seqlens=torch.zeros(1, dtype=torch.int32)), ValueError, "S >= 1"),
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
        (dict(eps_low=1.5), "eps_low"),
        (dict(ratio_level="group"), "ratio_level"),
        (dict(policy_loss="reinforce"), "policy_loss"),
        (dict(method="gepo", ratio_level="sequence"), "ratio_level"),
        (dict(method="gepo", policy_loss="cispo"), "policy_loss"),
        (dict(policy_loss="cispo", dual_clip=3.0), "dual_clip"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(temperature=0.0), "temperature"),
        (dict(kl_threshold="high"), "kl_threshold"),
        (dict(kl_reduction="padded_mean"), "kl_max_len"),
        (dict(normalization="constant"), "norm_max_len"),
        (dict(normalization="constant", norm_max_len=0), "norm_max_len"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(is_level="batch"), "is_level"),
        (dict(is_mode="clip"), "is_mode"),
        (dict(is_source="new"), "is_source"),
        (dict(is_min=0.0), "is_min"),
        (dict(is_min=2.0), "is_min"),  # not below is_cap
        (dict(is_min="low"), "is_min"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=float("inf")), "dual_clip"),
        (dict(delta=1.1), "delta"),  # not above 1 + eps_high
        (dict(delta=float("nan")), "delta"),
        (dict(kl_estimator="k2-gen"), "kl_estimator"),
        (dict(reject="geometric", reject_max=1.0), "reject"),
        (dict(reject="mean"), "reject_max"),  # required with reject
        (dict(reject="token", reject_max=float("nan")), "reject_max"),
        (dict(reject="token", reject_max=1.0, reject_min=1.0), "reject_min"),  # not below reject_max
        (dict(reject="sum", reject_max=1.0, reject_estimator="k4"), "reject_estimator"),
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


def test_cu_seqlens_errors_point_at_the_entry():
    n = _n()
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0, got 1"):
        _call(cu_seqlens=torch.tensor([1, 2, 3, 4, 5, 6, n], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\]=2 <= cu_seqlens\[1\]=3"):
        _call(cu_seqlens=torch.tensor([0, 3, 2, 4, 5, 6, n], dtype=torch.int32))
    with pytest.raises(ValueError, match=f"the last entry must be N={n}"):
        _call(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.int32))


def test_nan_in_logits_is_named_on_the_logits_entry_point():
    logits = torch.zeros(3, 5)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"logits: contains NaN or inf \(it reaches row 1 of logits"):
        ftis_kernels.ftis_loss(logits, torch.tensor([0, 1, 2]), torch.zeros(3), torch.zeros(1),
                               torch.tensor([0, 3], dtype=torch.int32), backend="torch")


# issue 78, findings 9 and 11: absurd ints, devices without values, bounds of the config's floats; and the same
# classes through every public function of ftis_kernels


def _small():
    return dict(targets=torch.tensor([0, 1, 2, 3]), gen_logprobs=-torch.ones(4), advantages=torch.tensor([1.0, -1.0]),
                cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))


@pytest.mark.parametrize("options, name", [
    (dict(num_sequences=10**30), "num_sequences"), (dict(num_tokens=10**30, normalization="token"), "num_tokens"),
    (dict(num_sequences=2**53 + 1), "num_sequences"), (dict(mini_batch_index=10**30), "mini_batch_index"),
    (dict(kl_reduction="padded_mean", kl_max_len=10**30), "kl_max_len"),
    (dict(normalization="constant", norm_max_len=10**30), "norm_max_len"),
    (dict(ignore_index=10**30), "ignore_index"), (dict(ignore_index=-(2**63) - 1), "ignore_index"),
])
def test_an_int_beyond_what_the_op_can_count_is_a_value_error_naming_it(options, name):
    for entry in ("logits", "hidden"):
        with pytest.raises(ValueError, match=rf"^(LossConfig\.)?{name}: "):
            if entry == "logits":
                ftis_kernels.ftis_loss(torch.randn(4, 5), **_small(), backend="torch", **options)
            else:
                ftis_kernels.fused_linear_ftis_loss(torch.randn(4, 3), torch.randn(5, 3), **_small(), backend="torch",
                                                    **options)


def test_the_largest_counts_are_accepted():
    out = ftis_kernels.ftis_loss(torch.randn(4, 5), **_small(), backend="torch", num_sequences=2**53,
                                 num_tokens=2**53, normalization="token")
    assert torch.isfinite(out.loss) and float(out.loss) != 0.0


@pytest.mark.parametrize("which", ["hidden", "weight", "bias", "logits"])
def test_a_tensor_on_the_meta_device_is_a_value_error_naming_it_and_the_device(which):
    meta = {"hidden": torch.randn(4, 3), "weight": torch.randn(5, 3), "bias": torch.randn(5)}
    meta[which] = meta.get(which, torch.randn(4, 5)).to("meta")
    message = rf"^{which}: on the meta device, which holds no values"
    with pytest.raises(ValueError, match=message):
        if which == "logits":
            ftis_kernels.ftis_loss(torch.randn(4, 5, device="meta"), **_small())
        else:
            ftis_kernels.fused_linear_ftis_loss(meta["hidden"], meta["weight"], **_small(), bias=meta["bias"])
    with pytest.raises(ValueError, match=message):  # the no-grad helpers and the modules alike
        if which == "logits":
            ftis_kernels.token_logprobs(torch.randn(4, 5, device="meta"), _small()["targets"])
        else:
            ftis_kernels.fused_linear_token_logprobs(meta["hidden"], meta["weight"], _small()["targets"],
                                                     bias=meta["bias"])
    if which == "hidden":
        with pytest.raises(ValueError, match=message):
            ftis_kernels.FusedLinearFTISLoss()(meta["hidden"], meta["weight"], *_small().values())


@pytest.mark.parametrize("options, field", [
    (dict(kl_threshold=-1.0), "kl_threshold"), (dict(kl_threshold=-float("inf")), "kl_threshold"),
    (dict(kl_threshold=-1e-9, kl_estimator="k2"), "kl_threshold"),
    (dict(kl_threshold=-0.5, kl_estimator="k3-gen"), "kl_threshold"),
    (dict(is_cap=1e-320), "is_cap"), (dict(is_cap=2.0611536e-09), "is_cap"), (dict(temperature=1e-320), "temperature"),
    (dict(temperature=1e-6), "temperature"),
])
def test_a_loss_option_outside_its_bounds_is_refused_naming_it(options, field):
    with pytest.raises(ValueError, match=rf"^LossConfig\.{field}: must be"):
        LossConfig(**options)


def test_the_bounds_keep_the_values_in_use():
    """0 and inf for the threshold (filter everything / nothing), below 0 for the signed estimators k1 and k1-gen
    (whose sums may be negative), a cap just above exp(-20), T = 1e-5."""
    for options in (dict(kl_threshold=0.0), dict(kl_threshold=float("inf")), dict(is_cap=2.1e-9), dict(is_cap=1e9),
                    dict(temperature=1e-5), dict(kl_threshold=-2.0, kl_estimator="k1"),
                    dict(kl_threshold=-0.3, kl_estimator="k1-gen")):
        LossConfig(**options)


@pytest.mark.parametrize("override, field", [
    ("algorithm.kl_threshold=-1", "algorithm.kl_threshold"), ("algorithm.is_cap=1e-320", "algorithm.is_cap"),
    ("algorithm.is_cap=1e-9", "algorithm.is_cap"), ("algorithm.kl_max_len=1000000000000000000000000000000",
                                                    "algorithm.kl_max_len"),
])
def test_a_run_config_outside_the_ops_bounds_is_a_one_line_error_naming_the_field(override, field):
    from ftis_engine.config import ConfigError, load_config

    from .helpers import TINY

    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert str(info.value).startswith(f"{field}: ") and "\n" not in str(info.value)


def test_the_no_grad_helpers_refuse_nan_and_inf_as_the_loss_does():
    logits = torch.randn(3, 5)
    logits[1, 2] = float("nan")
    with pytest.raises(ftis_kernels.NonFiniteInputError, match=r"^logits: contains NaN or inf \(it reaches row 1"):
        ftis_kernels.token_logprobs(logits, torch.tensor([0, 1, 2]))
    weight = torch.randn(5, 3)
    weight[4, 0] = float("inf")  # every row's log-sum-exp reads it: +inf where the row's hidden[0] > 0
    # positive hidden states: a row whose hidden[0] were negative would meet -inf there, which log-sum-exp takes (the
    # test failed on one draw in eight with torch.randn)
    with pytest.raises(ftis_kernels.NonFiniteInputError, match=r"^hidden, weight or bias: contains NaN or inf"):
        ftis_kernels.fused_linear_token_logprobs(torch.rand(3, 3) + 0.5, weight, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^temperature: must be a finite number >= 1e-05"):
        ftis_kernels.token_logprobs(torch.randn(3, 5), torch.tensor([0, 1, 2]), temperature=1e-320)
    finite = ftis_kernels.token_logprobs(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    assert bool(torch.isfinite(finite).all()) and bool((finite < 0).all())


@pytest.mark.parametrize("rewards, groups, error, message", [
    (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), ValueError, "rewards: contains NaN or inf"),
    (torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]), ValueError, "rewards: contains NaN or inf"),
    (torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), ValueError, r"groups: expected shape \[2\]"),
    (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), TypeError, "groups: expected an integer tensor"),
    (torch.tensor([[1.0, 0.0]]), torch.tensor([[0, 0]]), ValueError, "rewards: expected a 1-D tensor"),
    (torch.tensor([1.0, 0.0], device="meta"), torch.tensor([0, 0]), ValueError, "rewards: on the meta device"),
    (torch.tensor([1.0, 0.0]), torch.tensor([0, 0], device="meta"), ValueError, "groups: on meta, but rewards"),
    ([1.0, 0.0], torch.tensor([0, 0]), TypeError, "rewards: expected a torch.Tensor"),
])
def test_group_advantages_refuses_bad_rewards_and_groups_naming_them(rewards, groups, error, message):
    with pytest.raises(error, match=rf"^{message}"):
        ftis_kernels.group_advantages(rewards, groups)


@pytest.mark.parametrize("args, error, message", [
    (("tis", {}, 10**30, 4), TypeError, "config: expected a LossConfig"),
    ((None, {}, 10**30, 4), ValueError, "num_sequences: must be an int in"),
    ((None, {}, 4, 0), ValueError, "num_tokens: must be an int in"),
    ((None, {}, True, 4), ValueError, "num_sequences"),
    ((None, {"rejected_frac": 0.1, "rejected_seq_frac": float("nan")}, 4, 4), ValueError,
     "stats: rejected_seq_frac must be a fraction"),
    ((None, {"rejected_frac": 2.0, "rejected_seq_frac": 0.0}, 4, 4), ValueError, "stats: rejected_frac"),
])
def test_rejection_scale_refuses_bad_counts_and_stats_naming_them(args, error, message):
    config = LossConfig(reject="mean", reject_max=1.0, normalization="token")
    args = (config if args[0] is None else args[0], *args[1:])
    with pytest.raises(error, match=rf"^{message}"):
        ftis_kernels.rejection_scale(*args)
    assert ftis_kernels.rejection_scale(config, {"rejected_frac": 0.5, "rejected_seq_frac": 0.0}, 4, 4) == 2.0


def test_resolve_backend_takes_a_device_name_and_refuses_what_is_none():
    assert ftis_kernels.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"^device: not a torch device: 'gpu0'"):
        ftis_kernels.resolve_backend("auto", "gpu0")
