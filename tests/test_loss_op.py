"""The fused loss op against the float64 oracle: every method and option, both backends, both entry points."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ftis_kernels
from ftis_kernels import LossConfig, STAT_KEYS

from .oracle import oracle
from .problems import make_problem

BACKENDS = ["torch", "triton"]

CASES = {
    "nois": dict(method="nois"),
    "vis": dict(method="vis"),
    "tis": dict(method="tis"),
    "f-nois": dict(method="f-nois"),
    "f-vis": dict(method="f-vis"),
    "f-tis": dict(method="f-tis"),
    "gepo": dict(method="gepo"),
    "gepo-groups": dict(method="gepo", _groups=True),
    "k1-mean": dict(kl_estimator="k1", kl_reduction="mean"),
    "k2-padded": dict(kl_estimator="k2", kl_reduction="padded_mean", kl_max_len=16),
    "token-norm": dict(normalization="token"),
    "constant-norm": dict(normalization="constant", norm_max_len=12),
    "temperature": dict(temperature=0.7),
    "old-logprobs-tis": dict(method="f-tis", _old=True, eps_high=0.28),
    "old-logprobs-nois": dict(method="nois", _old=True),
    "cap-3": dict(is_cap=3.0, eps_low=0.1),
    # SPEC 2b: off-policy options beyond the paper
    "is-sequence-mask": dict(method="tis", is_level="sequence", is_mode="mask", is_cap=3.0, is_min=0.3),
    "is-sequence-truncate": dict(method="f-tis", is_level="sequence", is_cap=3.0),
    "is-geometric-min": dict(method="f-tis", is_level="geometric", is_min=0.8),
    "is-token-mask": dict(method="tis", is_mode="mask", is_min=0.5),
    "is-from-old": dict(method="f-tis", _old=True, is_source="old", is_level="geometric", is_cap=1.05),
    "k1-gen": dict(kl_estimator="k1-gen", kl_reduction="mean"),
    "k3-gen": dict(kl_estimator="k3-gen"),
    "dual-clip": dict(method="vis", dual_clip=1.5),
    "delta": dict(method="f-vis", delta=1.5),
    "gspo": dict(method="nois", _old=True, ratio_level="sequence", eps_low=0.03, eps_high=0.04),
    "gspo-vis-token-norm": dict(method="f-vis", ratio_level="sequence", normalization="token"),
    "cispo": dict(method="nois", _old=True, policy_loss="cispo", eps_low=1.0, eps_high=0.05, normalization="token"),
    "cispo-tis": dict(method="f-tis", _old=True, policy_loss="cispo", eps_low=0.05, eps_high=0.05),
    "reject-token": dict(method="tis", reject="token", reject_estimator="k1-gen", _reject_min=True,
                         normalization="token"),
    "reject-sum": dict(method="f-tis", reject="sum", reject_estimator="k3-gen"),
    "reject-mean-old": dict(method="tis", _old=True, is_source="old", reject="mean", reject_estimator="k1-gen",
                            _reject_min=True),
    "reject-max-gepo": dict(method="gepo", _groups=True, reject="max", reject_estimator="k2"),
    "reject-sum-constant": dict(method="nois", reject="sum", reject_estimator="k3", normalization="constant",
                                norm_max_len=12),
    "dual-clip-delta-tis": dict(method="tis", _old=True, dual_clip=1.02, delta=1.03, eps_low=0.01, eps_high=0.01),
    "reject-token-is-geometric-all": dict(method="tis", reject="token", reject_estimator="k1-gen", _reject_min=True,
                                          is_level="geometric", is_tokens="all", is_cap=1.5),
    "cispo-cap-below-one": dict(method="nois", _old=True, policy_loss="cispo", eps_low=1.0, eps_high=-0.8,
                                normalization="token"),
    # sequences whose generator gave only a sequence log-probability (another tokenizer): gen_seq_logprobs
    "foreign-f-tis": dict(method="f-tis", _foreign=True),
    "foreign-sequence-tis": dict(method="tis", is_level="sequence", is_cap=3.0, _foreign=True),
    "foreign-gepo": dict(method="gepo", _groups=True, _foreign=True),
    "foreign-reject-old": dict(method="f-tis", _old=True, is_source="old", reject="mean", reject_estimator="k1-gen",
                               _foreign=True),
    "foreign-f-vis-k1-mean": dict(method="f-vis", kl_estimator="k1", kl_reduction="mean", _foreign=True),
    # KL to a reference policy (TRL beta, verl kl_loss): ref_logprobs
    "beta-k3-f-tis": dict(method="f-tis", beta=0.3, _ref=True),
    "beta-k2-nois-token": dict(method="nois", _old=True, beta=0.5, ref_kl_estimator="k2", normalization="token",
                               _ref=True),
    "beta-k1-reject": dict(method="tis", beta=0.2, ref_kl_estimator="k1", reject="sum", reject_estimator="k3-gen",
                           _ref=True),
    "ref-kl-reported-beta-0": dict(method="f-tis", _ref=True),
    # entropy bonus (verl entropy_coeff): the entropy's gradient through both backends' fused passes
    "entropy-f-tis": dict(method="f-tis", entropy_coef=0.05),
    "entropy-penalty-token-temperature": dict(method="tis", entropy_coef=-0.3, normalization="token",
                                              temperature=0.7),
    "entropy-beta-reject": dict(method="tis", entropy_coef=0.1, beta=0.2, reject="sum", reject_estimator="k3-gen",
                                _ref=True),
}
# each SPEC 2b case, and the LossConfig fields that make it differ from the paper's loss
OPTION_CASES = [name for name in CASES if name.startswith(("is-", "k1-gen", "k3-gen", "dual-", "delta", "gspo", "cispo",
                                                                "reject-", "beta-", "entropy-"))]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-6))


def configure(case: dict, problem) -> tuple[LossConfig, dict]:
    """LossConfig for a case, with kl_threshold at the median oracle KL so that some sequences are filtered."""
    options = {k: v for k, v in case.items() if not k.startswith("_")}
    probe = LossConfig(**{**options, "method": "tis", "reject": "none"})
    kls = sorted(_sequence_kls(problem, probe))
    middle = len(kls) // 2
    options["kl_threshold"] = (kls[middle - 1] + kls[middle]) / 2  # between two sequences, never on one
    if options.get("reject", "none") != "none":  # bounds between two statistics: some rejected, some kept
        probe = LossConfig(**{**options, "reject_max": 1e300, "reject_min": None})
        values = sorted(oracle(problem.logits(), problem.targets, problem.gen, problem.adv, problem.cu, probe,
                               old=problem.old if case.get("_old") else None)[2]["_reject_statistics"])
        upper = int(len(values) * 0.7)
        options["reject_max"] = (values[upper - 1] + values[upper]) / 2
        if case.get("_reject_min"):
            lower = max(int(len(values) * 0.15), 1)
            options["reject_min"] = (values[lower - 1] + values[lower]) / 2
    options = {k: v for k, v in options.items() if not k.startswith("_")}
    extra = {
        "old_logprobs": problem.old if case.get("_old") else None,
        "group_ids": problem.group_ids if case.get("_groups") else None,
    }
    if case.get("_foreign"):
        extra["gen_seq_logprobs"] = foreign_logprobs(problem)
    if case.get("_ref"):  # a reference policy about 0.5 nats from the current one
        g = torch.Generator().manual_seed(17)
        extra["ref_logprobs"] = (problem.old + 0.5 * torch.randn(problem.old.shape, generator=g)).clamp(max=-1e-3)
    return LossConfig(**options), extra


def foreign_logprobs(problem) -> torch.Tensor:
    """gen_seq_logprobs for every other sequence: its tokens' gen log-probs summed, moved by up to 1 nat (a
    generator that tokenised the text otherwise); NaN (per-token gen log-probs known) for the rest."""
    g = torch.Generator().manual_seed(int(problem.cu[-1]))
    out = torch.full((problem.adv.numel(),), float("nan"))
    for i in range(1, problem.adv.numel(), 2):
        total = float(problem.gen[int(problem.cu[i]) : int(problem.cu[i + 1])].sum())
        out[i] = min(total + float(torch.rand((), generator=g)) * 2 - 1, 0.0)
    return out


def _sequence_kls(problem, cfg) -> list[float]:
    kls = []
    for i in range(problem.adv.numel()):
        one = slice(int(problem.cu[i]), int(problem.cu[i + 1]))
        cu = torch.tensor([0, one.stop - one.start], dtype=torch.int32)
        _, _, st = oracle(problem.logits()[one], problem.targets[one], problem.gen[one], problem.adv[i : i + 1], cu, cfg)
        kls.append(st["kl_mean"])
    return kls


def run_ours(problem, cfg, extra, backend, fused, dtype=torch.float32):
    hidden = problem.hidden.to(dtype).requires_grad_()
    weight = problem.weight.to(dtype).requires_grad_()
    bias = problem.bias.to(dtype).requires_grad_()
    if fused:
        out = ftis_kernels.fused_linear_ftis_loss(
            hidden, weight, problem.targets, problem.gen, problem.adv, problem.cu, bias=bias, config=cfg,
            backend=backend, **extra,
        )
        out.loss.backward()
        return out, {"hidden": hidden.grad, "weight": weight.grad, "bias": bias.grad}
    logits = problem.logits().to(dtype).requires_grad_()
    out = ftis_kernels.ftis_loss(logits, problem.targets, problem.gen, problem.adv, problem.cu, config=cfg,
                                 backend=backend, **extra)
    out.loss.backward()
    return out, {"logits": logits.grad}


def run_oracle(problem, cfg, extra, dtype=torch.float64):
    """The oracle on inputs rounded to `dtype` first, so that only the op's own arithmetic is compared."""
    hidden = problem.hidden.to(dtype).double().requires_grad_()
    weight = problem.weight.to(dtype).double().requires_grad_()
    bias = problem.bias.to(dtype).double().requires_grad_()
    logits = (hidden @ weight.T + bias)
    logits.retain_grad()
    loss, logprobs, stats = oracle(logits, problem.targets, problem.gen, problem.adv, problem.cu, cfg,
                                   old=extra["old_logprobs"], group_ids=extra["group_ids"],
                                   gen_seq=extra.get("gen_seq_logprobs"), ref_lp=extra.get("ref_logprobs"))
    loss.backward()
    grads = {"hidden": hidden.grad, "weight": weight.grad, "bias": bias.grad, "logits": logits.grad}
    return loss.detach(), logprobs, stats, grads


@pytest.mark.parametrize("fused", [True, False], ids=["fused-linear", "logits"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_float64_oracle_in_fp32(case, backend, fused):
    problem = make_problem(seed=sum(map(ord, case)))
    cfg, extra = configure(CASES[case], problem)
    out, grads = run_ours(problem, cfg, extra, backend, fused)
    ref_loss, ref_logprobs, ref_stats, ref_grads = run_oracle(problem, cfg, extra)

    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert rel_err(out.loss, ref_loss) <= 1e-4
    assert rel_err(out.logprobs, ref_logprobs) <= 1e-4
    assert set(out.stats) == set(STAT_KEYS)
    for key in STAT_KEYS:
        assert float(out.stats[key]) == pytest.approx(ref_stats[key], rel=1e-4, abs=1e-6), key
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-4, name


@pytest.mark.parametrize("case", OPTION_CASES)
def test_each_off_policy_option_changes_the_loss_its_case_tests(case):
    """Guards the oracle comparisons above: each option case's problem makes its option matter."""
    problem = make_problem(seed=sum(map(ord, case)))
    cfg, extra = configure(CASES[case], problem)
    paper = cfg.replace(is_level="token", is_mode="truncate", is_min=None, is_source="current", dual_clip=None,
                        delta=None, kl_estimator="k3", ratio_level="token", policy_loss="ppo",
                        reject="none", is_tokens="kept", eps_high=max(cfg.eps_high, 0.0), beta=0.0, entropy_coef=0.0,
                        kl_threshold=max(cfg.kl_threshold, 0.0))  # k3's estimates are >= 0: a threshold below 0 is 0's
    with_option, *_ = run_oracle(problem, cfg, extra)
    without, *_ = run_oracle(problem, paper, extra)
    assert abs(float(with_option) - float(without)) > 1e-3 * max(abs(float(without)), 1e-3)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-linear", "logits"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_error_is_bounded(dtype, backend, fused):
    """Half-precision inputs, fp32 arithmetic: the only rounding left is the gradient's own dtype (the gradient
    tile is rounded to the input dtype before the matmuls, as the stored logits gradient is). Bound: 2e-2 on
    gradients (bf16 has 8 bits of mantissa), 1e-4 on loss and log-probs."""
    problem = make_problem(seed=7, n_seqs=5)
    cfg, extra = configure(CASES["f-tis"], problem)
    out, grads = run_ours(problem, cfg, extra, backend, fused, dtype=dtype)
    ref_loss, ref_logprobs, _, ref_grads = run_oracle(problem, cfg, extra, dtype=dtype)
    if not fused:  # the oracle's logits come from rounded hidden/weight; ours are rounded once more
        ref_loss, ref_logprobs, _, ref_grads = _oracle_from_logits(problem.logits().to(dtype), problem, cfg, extra)
    assert rel_err(out.loss, ref_loss) <= 1e-4
    assert rel_err(out.logprobs, ref_logprobs) <= 1e-4
    for name, grad in grads.items():
        assert grad.dtype == dtype
        assert rel_err(grad, ref_grads[name]) <= 2e-2, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_autocast_the_fused_op_takes_its_operands_in_autocasts_dtype_and_computes_in_float32(backend):
    """float32 master hidden / weight / bias inside bf16 autocast: the same loss, log-probs and stats as the op called
    with the three cast to bf16 outside autocast (autocast reaches nothing inside the op: its arithmetic is float32),
    and the gradients arrive in float32, equal to the bf16 call's widened."""
    problem = make_problem(seed=3, n_seqs=5)
    cfg, extra = configure(CASES["f-tis"], problem)
    args = (problem.targets, problem.gen, problem.adv, problem.cu)
    master = [t.float().requires_grad_() for t in (problem.hidden, problem.weight, problem.bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = ftis_kernels.fused_linear_ftis_loss(master[0], master[1], *args, bias=master[2], config=cfg,
                                                     backend=backend, **extra)
    inside.loss.backward()
    half = [t.detach().bfloat16().requires_grad_() for t in master]
    outside = ftis_kernels.fused_linear_ftis_loss(half[0], half[1], *args, bias=half[2], config=cfg, backend=backend,
                                                  **extra)
    outside.loss.backward()
    assert torch.equal(inside.loss, outside.loss) and torch.equal(inside.logprobs, outside.logprobs)
    assert all(torch.equal(inside.stats[k], outside.stats[k]) for k in inside.stats)
    for m, h in zip(master, half):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, h.grad.float())
    targets = problem.targets.clamp(min=0)  # the helper takes no ignore_index
    with torch.autocast("cpu", dtype=torch.bfloat16):
        helper = ftis_kernels.fused_linear_token_logprobs(master[0].detach(), master[1].detach(), targets,
                                                          bias=master[2].detach())
    assert torch.equal(helper, ftis_kernels.fused_linear_token_logprobs(*[t.detach() for t in half[:2]], targets,
                                                                        bias=half[2].detach()))


def _oracle_from_logits(logits_half, problem, cfg, extra):
    logits = logits_half.double().requires_grad_()
    loss, logprobs, stats = oracle(logits, problem.targets, problem.gen, problem.adv, problem.cu, cfg,
                                   old=extra["old_logprobs"], group_ids=extra["group_ids"])
    loss.backward()
    return loss.detach(), logprobs, stats, {"logits": logits.grad}


@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("foreign-")])
def test_a_sequence_log_probability_changes_the_loss_its_case_tests(case):
    """Guards the foreign cases above: the sequences given only a sequence log-probability matter."""
    problem = make_problem(seed=sum(map(ord, case)))
    cfg, extra = configure(CASES[case], problem)
    with_seq, *_ = run_oracle(problem, cfg, extra)
    without, *_ = run_oracle(problem, cfg, {**extra, "gen_seq_logprobs": None})
    assert abs(float(with_seq) - float(without)) > 1e-3 * max(abs(float(without)), 1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sequence_weight_from_the_sequence_log_probability_equals_the_one_from_its_tokens(backend):
    """is_level sequence, no filter: a sequence's weight depends on its generation log-probs only through their
    sum, so giving that sum (and garbage per-token values) leaves the loss and gradients unchanged."""
    problem = make_problem(seed=21, ignore_frac=0.0)
    cfg = LossConfig(method="tis", is_level="sequence", is_cap=3.0)
    sums = torch.stack([problem.gen[int(problem.cu[i]) : int(problem.cu[i + 1])].sum()
                        for i in range(problem.adv.numel())])
    common = dict(bias=problem.bias.float(), config=cfg, backend=backend)
    hidden = problem.hidden.float().requires_grad_()
    a = ftis_kernels.fused_linear_ftis_loss(hidden, problem.weight.float(), problem.targets, problem.gen,
                                            problem.adv, problem.cu, **common)
    a.loss.backward()
    grad_a, hidden.grad = hidden.grad.clone(), None
    b = ftis_kernels.fused_linear_ftis_loss(hidden, problem.weight.float(), problem.targets,
                                            torch.full_like(problem.gen, -7.0), problem.adv, problem.cu,
                                            gen_seq_logprobs=sums, **common)
    b.loss.backward()
    assert float(b.loss.detach()) == pytest.approx(float(a.loss.detach()), rel=1e-5)
    assert float(b.stats["is_weight_mean"]) == pytest.approx(float(a.stats["is_weight_mean"]), rel=1e-5)
    assert rel_err(hidden.grad, grad_a) <= 1e-5


@pytest.mark.parametrize("bad, message", [
    (lambda s: s[:-1], "one per sequence"),
    (lambda s: torch.where(torch.arange(s.numel()) == 0, torch.tensor(0.5), s), "finite and <= 0"),
    (lambda s: torch.where(torch.arange(s.numel()) == 0, torch.tensor(-float("inf")), s), "finite and <= 0"),
    (lambda s: s.long(), "gen_seq_logprobs"),
])
def test_bad_sequence_log_probabilities_are_refused_naming_the_argument(bad, message):
    problem = make_problem(seed=4)
    good = torch.full((problem.adv.numel(),), -3.0)
    with pytest.raises((ValueError, TypeError), match=message):
        ftis_kernels.fused_linear_ftis_loss(problem.hidden.float(), problem.weight.float(), problem.targets,
                                            problem.gen, problem.adv, problem.cu, backend="torch",
                                            gen_seq_logprobs=bad(good))


def test_filter_zeroes_the_gradient_of_filtered_sequences():
    """A filtered sequence (A <= 0, KL >= g) contributes no gradient but still counts in the normaliser."""
    problem = make_problem(seed=3, n_seqs=4, spread=3.0)
    problem.adv[:] = torch.tensor([-1.0, -0.5, 0.7, 0.9])
    hidden = problem.hidden.float().requires_grad_()
    common = dict(bias=problem.bias.float(), backend="torch", kl_threshold=0.0)
    out = ftis_kernels.fused_linear_ftis_loss(hidden, problem.weight.float(), problem.targets, problem.gen,
                                              problem.adv, problem.cu, **common)
    out.loss.backward()
    assert float(out.stats["filtered_frac"]) == 0.5
    first_two = slice(0, int(problem.cu[2]))
    assert torch.all(hidden.grad[first_two] == 0)
    assert torch.any(hidden.grad[int(problem.cu[2]):] != 0)
    # the unfiltered sequences' loss is divided by all 4 sequences
    kept = ftis_kernels.fused_linear_ftis_loss(
        problem.hidden.float()[first_two.stop:], problem.weight.float(), problem.targets[first_two.stop:],
        problem.gen[first_two.stop:], problem.adv[2:], problem.cu[2:] - problem.cu[2], **common,
    )
    assert out.loss.item() == pytest.approx(kept.loss.item() * 2 / 4, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_and_torch_backends_agree_on_a_larger_vocabulary(backend):
    problem = make_problem(seed=11, n_seqs=4, max_len=20, vocab=333, dim=40)
    cfg, extra = configure(CASES["f-tis"], problem)
    out, grads = run_ours(problem, cfg, extra, backend, fused=True)
    ref_loss, _, _, ref_grads = run_oracle(problem, cfg, extra)
    assert rel_err(out.loss, ref_loss) <= 1e-4
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-4, name


def test_module_wrappers_match_the_functions():
    problem = make_problem(seed=5)
    cfg = LossConfig(method="tis", is_cap=1.5)
    module = ftis_kernels.FusedLinearFTISLoss(cfg, backend="torch")
    args = (problem.hidden.float(), problem.weight.float(), problem.targets, problem.gen, problem.adv, problem.cu)
    a = module(*args, bias=problem.bias.float())
    b = ftis_kernels.fused_linear_ftis_loss(*args, bias=problem.bias.float(), config=cfg, backend="torch")
    assert torch.equal(a.loss, b.loss)
    logits = problem.logits().float()
    c = ftis_kernels.FTISLoss(cfg, backend="torch")(logits, problem.targets, problem.gen, problem.adv, problem.cu)
    assert float(c.loss) == pytest.approx(float(a.loss), rel=1e-5)


def test_every_optional_input_reaches_the_op_alike_through_the_functions_and_the_modules():
    """The op's inputs are declared once (LossInputs): its optional fields are the keyword inputs of both functions
    and both modules, which compute the same loss from them; any other keyword is refused naming it."""
    from ftis_kernels.config import OPTIONAL_INPUTS

    assert set(OPTIONAL_INPUTS) == {f.name for f in dataclasses.fields(ftis_kernels.LossInputs)} - {
        "targets", "gen_logprobs", "advantages", "cu_seqlens"}
    problem = make_problem(seed=5)
    cfg = LossConfig(method="f-tis", beta=0.1)  # (group_ids: only gepo reads them; checked all the same)
    n, s = problem.targets.numel(), problem.adv.numel()
    inputs = dict(old_logprobs=problem.gen - 0.01, group_ids=torch.arange(s) % 2, num_sequences=s + 1,
                  num_tokens=n + 3, gen_seq_logprobs=torch.full((s,), float("nan")), ref_logprobs=problem.gen - 0.02,
                  is_self=torch.arange(s) % 2 == 0, gen_seq_tokens=torch.ones(s, dtype=torch.int32),
                  capability_ratio=torch.full((s,), 2.0), mini_batch_index=1)  # hacpo's: only hacpo reads them
    assert set(inputs) == set(OPTIONAL_INPUTS)
    args = (problem.targets, problem.gen, problem.adv, problem.cu)
    hidden, weight = problem.hidden.float(), problem.weight.float()
    bias = problem.bias.float()
    fused = ftis_kernels.fused_linear_ftis_loss(hidden, weight, *args, bias=bias, config=cfg, backend="torch", **inputs)
    module = ftis_kernels.FusedLinearFTISLoss(cfg, backend="torch")(hidden, weight, *args, bias=bias, **inputs)
    assert torch.equal(fused.loss, module.loss)
    plain = ftis_kernels.ftis_loss(problem.logits().float(), *args, config=cfg, backend="torch", **inputs)
    assert float(plain.loss) == pytest.approx(float(fused.loss), rel=1e-5)
    without = ftis_kernels.fused_linear_ftis_loss(hidden, weight, *args, bias=bias, config=cfg, backend="torch",
                                                  ref_logprobs=inputs["ref_logprobs"])
    assert not torch.equal(without.loss, fused.loss)  # the inputs were used
    with pytest.raises(ValueError, match=r"^old_logprob: neither an input of the loss \(old_logprobs, "):
        ftis_kernels.fused_linear_ftis_loss(hidden, weight, *args, backend="torch", old_logprob=problem.gen)
    with pytest.raises(ValueError, match=r"^method: not an input of the loss .* a module's loss options are its "):
        ftis_kernels.FTISLoss(cfg)(problem.logits().float(), *args, method="tis")


def test_overrides_replace_config_fields():
    problem = make_problem(seed=9)
    logits = problem.logits().float()
    args = (logits, problem.targets, problem.gen, problem.adv, problem.cu)
    via_override = ftis_kernels.ftis_loss(*args, config=LossConfig(method="nois"), method="vis", backend="torch")
    via_config = ftis_kernels.ftis_loss(*args, config=LossConfig(method="vis"), backend="torch")
    assert torch.equal(via_override.loss, via_config.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_helpers_match_log_softmax(backend, monkeypatch):
    problem = make_problem(seed=13, ignore_frac=0.0)
    logits = problem.logits()
    ref = torch.log_softmax(logits / 0.8, -1).gather(1, problem.targets[:, None]).squeeze(1)
    if backend == "triton":
        monkeypatch.setattr(ftis_kernels.api, "resolve_backend", lambda b, d: "triton")
    a = ftis_kernels.token_logprobs(logits.float(), problem.targets, temperature=0.8)
    b = ftis_kernels.fused_linear_token_logprobs(problem.hidden.float(), problem.weight.float(), problem.targets,
                                                 temperature=0.8, bias=problem.bias.float())
    assert a.dtype == torch.float32 and not a.requires_grad
    assert rel_err(a, ref) <= 1e-5 and rel_err(b, ref) <= 1e-5


def test_gradcheck_float64_torch_backend():
    """torch.autograd.gradcheck through the whole op (old log-probs given, so no detached quantity moves)."""
    problem = make_problem(seed=17, n_seqs=3, max_len=4, vocab=11, dim=5)
    hidden = problem.hidden.clone().requires_grad_()
    weight = problem.weight.clone().requires_grad_()
    bias = problem.bias.clone().requires_grad_()
    old = problem.old.double()
    gen = problem.gen.double() - 30.0  # w = C everywhere: the truncated weight is a constant, as the op treats it

    def loss_fn(method):
        def f(h, w, b):
            return ftis_kernels.fused_linear_ftis_loss(h, w, problem.targets, gen, problem.adv.double(), problem.cu,
                                                       bias=b, old_logprobs=old, method=method, backend="torch",
                                                       kl_threshold=1e9).loss
        return f

    for method in ("nois", "tis", "vis", "gepo"):
        assert torch.autograd.gradcheck(loss_fn(method), (hidden, weight, bias))
    logits = problem.logits().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: ftis_kernels.ftis_loss(z, problem.targets, gen, problem.adv.double(), problem.cu, old_logprobs=old,
                                         backend="torch", temperature=0.6).loss,
        (logits,),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_log_ratios_give_finite_loss_and_gradients(backend):
    problem = make_problem(seed=19)
    gen = torch.full_like(problem.gen, -1e4)
    gen[::2] = 0.0
    old = torch.full_like(problem.old, -1e4)
    logits = (problem.logits() * 1e3).float().requires_grad_()  # log-probs down to about -1e4 as well
    for method in ("f-tis", "vis", "gepo"):
        for estimator in ("k1", "k2", "k3"):
            out = ftis_kernels.ftis_loss(logits, problem.targets, gen, problem.adv, problem.cu, old_logprobs=old,
                                         method=method, kl_estimator=estimator, backend=backend)
            (grad,) = torch.autograd.grad(out.loss, logits)
            assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
            assert all(torch.isfinite(v) for v in out.stats.values())


def test_ignored_positions_count_nowhere():
    """Changing the logits, generation log-probs or targets' neighbours at ignored positions changes nothing."""
    problem = make_problem(seed=23, ignore_frac=0.4)
    ignored = problem.targets == -100
    assert ignored.any()
    logits = problem.logits().float()
    out = ftis_kernels.ftis_loss(logits, problem.targets, problem.gen, problem.adv, problem.cu, backend="torch")
    logits2, gen2 = logits.clone(), problem.gen.clone()
    logits2[ignored] = torch.randn_like(logits2[ignored]) * 5
    gen2[ignored] = -3.0
    out2 = ftis_kernels.ftis_loss(logits2, problem.targets, gen2, problem.adv, problem.cu, backend="torch")
    assert torch.equal(out.loss, out2.loss)
    assert torch.all(out.logprobs[ignored] == 0)
    for key in STAT_KEYS:
        assert torch.equal(out.stats[key], out2.stats[key]), key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["f-vis", "f-tis", "gepo"])
def test_a_sequence_whose_every_target_is_ignored_counts_in_no_stat(method, backend):
    """Sequence 2's targets all ignore_index: the per-sequence stats (filtered_frac, kl_mean, gepo's clip_frac)
    are over the other sequences, it is never filtered (a threshold of 0 would filter its KL of 0), and every stat
    is the oracle's; with it dropped from the batch, the per-sequence stats are the same."""
    problem = make_problem(seed=31, n_seqs=5)
    cu = problem.cu.tolist()
    targets = problem.targets.clone()
    targets[cu[2]:cu[3]] = -100
    adv = problem.adv.clone()
    adv[2] = -1.0  # A <= 0: only its empty KL keeps it from the filter
    cfg = LossConfig(method=method, kl_threshold=0.0 if method != "gepo" else 50.0)
    out = ftis_kernels.ftis_loss(problem.logits().float(), targets, problem.gen, adv, problem.cu, config=cfg,
                                 backend=backend)
    _, _, ref = oracle(problem.logits(), targets, problem.gen, adv, problem.cu, cfg)
    for key in STAT_KEYS:
        assert float(out.stats[key]) == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    assert not bool(out.sequences["filtered"][2])
    keep = [i for i in range(5) if i != 2]
    rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in keep])
    lengths = torch.tensor([cu[i + 1] - cu[i] for i in keep])
    cu_without = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    without = ftis_kernels.ftis_loss(problem.logits().float()[rows], targets[rows], problem.gen[rows], adv[keep],
                                     cu_without, config=cfg, backend=backend)
    for key in ("filtered_frac", "kl_mean", "clip_frac"):
        assert float(out.stats[key]) == pytest.approx(float(without.stats[key]), rel=1e-5, abs=1e-7), key


# ----------------------------------------------------------------------------------------------- micro-batches

MICRO_CASES = ["f-tis", "tis", "vis", "token-norm", "constant-norm", "gepo-groups", "old-logprobs-tis"]


def _part(problem, extra, lo: int, hi: int):
    """Sequences [lo, hi) of a problem as a problem of their own (rows, cu_seqlens rebased)."""
    a, b = int(problem.cu[lo]), int(problem.cu[hi])
    part = type(problem)(problem.hidden[a:b], problem.weight, problem.bias, problem.targets[a:b], problem.gen[a:b],
                         problem.old[a:b], problem.adv[lo:hi], problem.cu[lo : hi + 1] - a, problem.group_ids[lo:hi])
    part_extra = {k: (None if v is None else v[a:b] if k == "old_logprobs" else v[lo:hi]) for k, v in extra.items()}
    return part, part_extra, slice(a, b)


def _run_parts(problem, cfg, extra, backend, fused):
    """The 8-sequence problem as micro-batches [0, 3), [3, 7), [7, 8), each given the whole batch's counts:
    (summed loss, summed gradients, the outputs, the counts)."""
    counts = dict(num_sequences=8, num_tokens=int((problem.targets != cfg.ignore_index).sum()))
    loss, outputs, grads = 0.0, [], {}
    for lo, hi in ((0, 3), (3, 7), (7, 8)):
        part, part_extra, rows = _part(problem, extra, lo, hi)
        out, part_grads = run_ours(part, cfg, {**part_extra, **counts}, backend, fused)
        loss += float(out.loss.detach())
        outputs.append(out)
        for k, g in part_grads.items():
            if k in ("hidden", "logits"):  # per-row gradients: this part's rows only
                full = grads.setdefault(k, g.new_zeros((int(problem.cu[-1]), *g.shape[1:])))
                full[rows] += g
            else:
                grads[k] = grads[k] + g if k in grads else g.clone()
    return loss, grads, outputs, counts


@pytest.mark.parametrize("fused", [True, False], ids=["fused-linear", "logits"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MICRO_CASES)
def test_micro_batches_with_the_whole_counts_add_up_to_one_call(case, backend, fused):
    """Gradient accumulation: each micro-batch's loss divided by the whole batch's sequences (or counted tokens),
    so the parts' losses and gradients sum to the one call's, and combine_stats gives its stats."""
    problem = make_problem(5, n_seqs=8)
    cfg, extra = configure(CASES[case], problem)
    if case.startswith("gepo"):
        extra["group_ids"] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])  # split at group boundaries only
    whole, whole_grads = run_ours(problem, cfg, extra, backend, fused)
    loss, grads, outputs, _ = _run_parts(problem, cfg, extra, backend, fused)
    whole_loss = float(whole.loss.detach())
    assert abs(loss - whole_loss) <= 1e-6 * max(1.0, abs(whole_loss))
    for k in grads:
        assert rel_err(grads[k], whole_grads[k]) < 1e-5, k
    merged = ftis_kernels.combine_stats(outputs)
    for key in STAT_KEYS:
        assert merged[key] == pytest.approx(float(whole.stats[key]), rel=1e-5, abs=1e-7), key


def test_stats_are_the_sums_over_their_counts():
    problem = make_problem(2)
    cfg, extra = configure(CASES["gepo-groups"], problem)
    out, _ = run_ours(problem, cfg, extra, "torch", True)
    tokens = int((problem.targets != cfg.ignore_index).sum())
    assert set(out.stat_sums) == set(out.stat_counts) == set(STAT_KEYS)
    for key in STAT_KEYS:
        per = 6 if key in ("filtered_frac", "kl_mean", "clip_frac", "rejected_seq_frac") else tokens  # gepo: sequences
        assert int(out.stat_counts[key]) == per and out.stat_counts[key].dtype == torch.int64
        assert float(out.stats[key]) == pytest.approx(float(out.stat_sums[key]) / per, rel=1e-6)
    assert ftis_kernels.combine_stats([out]) == pytest.approx({k: float(v) for k, v in out.stats.items()}, rel=1e-6)
    with pytest.raises(ValueError, match="outputs"):
        ftis_kernels.combine_stats([])
    with pytest.raises(TypeError, match="outputs"):
        ftis_kernels.combine_stats([out.stats])


@pytest.mark.parametrize("case", ["reject-token", "reject-sum", "reject-max-gepo", "reject-sum-constant"])
def test_rejection_micro_batches_rescaled_by_the_kept_counts_add_up_to_one_call(case):
    """Rejection shrinks the normaliser by counts no micro-batch knows in advance: each part is normalised by
    the whole batch's counts before rejection, and rejection_scale (from the combined stats) rescales the sum."""
    problem = make_problem(5, n_seqs=8)
    cfg, extra = configure(CASES[case], problem)
    if case.startswith("reject-max-gepo"):
        extra["group_ids"] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    whole, whole_grads = run_ours(problem, cfg, extra, "torch", True)
    assert 0 < float(whole.stats["rejected_frac"]) < 1
    loss, grads, outputs, counts = _run_parts(problem, cfg, extra, "torch", True)
    scale = ftis_kernels.rejection_scale(cfg, ftis_kernels.combine_stats(outputs), **counts)
    if case.endswith("constant"):
        assert scale == 1.0
    else:
        assert scale > 1.0
    whole_loss = float(whole.loss.detach())
    assert abs(loss * scale - whole_loss) <= 1e-6 * max(1.0, abs(whole_loss))
    for k in grads:
        assert rel_err(grads[k] * scale, whole_grads[k]) < 1e-5, k


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_per_sequence_values_are_the_ones_behind_the_stats(backend):
    """LossOutput.sequences: KL_i, the filter's verdict and each sequence's mean IS weight; their means over
    sequences (and tokens) are the op's own stats."""
    problem = make_problem(seed=11, n_seqs=6, spread=3.0)
    cfg, extra = configure(CASES["f-tis"], problem)
    out, _ = run_ours(problem, dataclasses.replace(cfg, kl_threshold=2.0), extra, backend, True)
    seqs = out.sequences
    assert seqs["kl"].shape == seqs["filtered"].shape == seqs["is_weight"].shape == (6,)
    assert seqs["filtered"].dtype == torch.bool and bool(seqs["filtered"].any())
    assert float(seqs["filtered"].float().mean()) == pytest.approx(float(out.stats["filtered_frac"]))
    assert float(seqs["kl"].mean()) == pytest.approx(float(out.stats["kl_mean"]), rel=1e-6)
    counted = (problem.targets != -100)
    tokens = torch.stack([counted[a:b].sum() for a, b in zip(problem.cu[:-1], problem.cu[1:])]).float()
    weighted = float((seqs["is_weight"] * tokens).sum() / tokens.sum())
    assert weighted == pytest.approx(float(out.stats["is_weight_mean"]), rel=1e-6)
