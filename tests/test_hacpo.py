"""method="hacpo": the op against its authors' code, transcribed in float64 (zzx-peter/HACRL-code), on random
inputs; both backends and entry points alike; each option, input and refusal.

The transcription is written from recipe/hacpo/hacpo_core_algos.py as published (commit 81e6c64): the loss of
compute_hacpo_loss (lines 168-225) on the learner's mean log-prob (sequence_mean_log_prob, lines 153-165) and the
lower bound of HacpoLossConfig.cross_clip_lower (lines 35-40). It takes its inputs in the authors' layout (padded
[B, T] log-probs and a response mask, one source mean per sequence) and shares no code with the op.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ftis_kernels
from ftis_kernels import LossConfig, STAT_KEYS

from .problems import make_problem

# hacpo.loss of the authors' recipe/hacpo/config/hacpo_trainer.yaml (lines 28-34)
AUTHORS_DEFAULTS = dict(self_clip_low=0.0003, self_clip_high=0.0004, cross_clip_delta=0.2, cross_clip_step=0.025,
                        alpha=1.0, max_abs_log_ratio=10.0)


def authors_loss(target_log_probs: torch.Tensor, response_mask: torch.Tensor, source_mean: torch.Tensor,
                 advantages: torch.Tensor, is_self: torch.Tensor, capability: torch.Tensor, m: int,
                 cfg: LossConfig) -> torch.Tensor:
    """The authors' HACPO loss, float64, in their layout: target_log_probs, response_mask [B, T]; the rest [B]."""
    mask = response_mask.double()
    target_mean = (target_log_probs * mask).sum(-1) / mask.sum(-1)  # sequence_mean_log_prob, lines 161-165
    bound = cfg.max_abs_log_ratio
    ratio = (target_mean - source_mean).clamp(-bound, bound).exp()  # lines 206-209
    self_term = torch.minimum(ratio * advantages,  # lines 211-215
                              ratio.clamp(1.0 - cfg.self_clip_low, 1.0 + cfg.self_clip_high) * advantages)
    lower = min(1.0, 1.0 - cfg.cross_clip_delta + m * cfg.cross_clip_step)  # cross_clip_lower, line 40; line 217
    kept = ratio.clamp(lower, 1.0)  # line 218
    cross_term = kept * kept.detach().pow(cfg.alpha) * capability * advantages  # lines 220-222 (alpha: detached)
    return -torch.where(is_self, self_term, cross_term).mean()  # lines 224-225


@dataclasses.dataclass
class Case:
    """One random HACPO problem: the op's packed inputs and what the authors' code is given for it."""

    problem: object
    is_self: torch.Tensor
    gen_seq: torch.Tensor  # [S] NaN or a foreign sequence's source log-prob sum
    gen_seq_tokens: torch.Tensor  # [S] the source's token count behind it (0 elsewhere)
    capability: torch.Tensor
    old: torch.Tensor


OFFSETS = (0.0, 2e-4, -2e-4, 0.1, -0.1, -0.3, 0.5, -1.5, 0.02)  # log-ratios that reach every branch


def make_case(seed: int, n_seqs: int = 8) -> Case:
    """A problem whose every sequence counts a token (the authors refuse one that does not), a mix of the learner's
    own sequences (i % 3 == 0), foreign ones (a source sum over a token count of their own, i % 3 == 2) and peers'
    with per-token log-probs, each source set so that its sequence's log-ratio is one of OFFSETS (the first two
    inside every default clip, so that the loss has a gradient), capability ratios in [0.1, 10] (the bounds of the
    authors' CapabilityTracker)."""
    problem = make_problem(seed=seed, n_seqs=n_seqs, max_len=7)
    cu = problem.cu.tolist()
    for i in range(n_seqs):  # un-ignore the first token of a sequence the problem left without one
        if bool((problem.targets[cu[i]:cu[i + 1]] == -100).all()):
            problem.targets[cu[i]] = seed % 75
    g = torch.Generator().manual_seed(seed + 1000)
    model = torch.log_softmax(problem.logits(), -1).gather(1, problem.targets.clamp(min=0)[:, None]).squeeze(1)
    is_self = torch.arange(n_seqs) % 3 == 0
    foreign = torch.arange(n_seqs) % 3 == 2
    offsets = torch.tensor([OFFSETS[int(k)] for k in torch.randint(0, len(OFFSETS), (n_seqs,), generator=g)])
    offsets[0], offsets[1] = OFFSETS[seed % 3], -0.1
    tokens = torch.where(foreign, torch.randint(1, 9, (n_seqs,), generator=g), torch.zeros(n_seqs, dtype=torch.long))
    gen_seq = torch.full((n_seqs,), float("nan"))
    old, gen = problem.old.clone(), problem.gen.clone()
    for i in range(n_seqs):
        rows = slice(cu[i], cu[i + 1])
        counted = problem.targets[rows] != -100
        source = model[rows] - float(offsets[i])  # its mean over the counted tokens: mean l - offset
        if bool(is_self[i]):
            old[rows] = source.clamp(max=0).float()
        elif bool(foreign[i]):
            gen_seq[i] = min(float(tokens[i]) * float(source[counted].mean()), 0.0)
        else:
            gen[rows] = source.clamp(max=0).float()
    problem = dataclasses.replace(problem, gen=gen, old=old)
    capability = 10 ** (2 * torch.rand(n_seqs, generator=g) - 1)
    return Case(problem, is_self, gen_seq, tokens.int(), capability, old)


def op_inputs(case: Case, m: int) -> dict:
    return dict(is_self=case.is_self, gen_seq_logprobs=case.gen_seq, gen_seq_tokens=case.gen_seq_tokens,
                capability_ratio=case.capability, old_logprobs=case.old, mini_batch_index=m)


def authors_inputs(case: Case, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_log_probs [B, T], response_mask [B, T], source_mean [B]) as the authors' code is given them: the
    learner's log-probs of its counted tokens, padded; the source mean over the source's own tokens (the old policy
    for the learner's own rollouts, the generator otherwise, sum / the generator's own count for a foreign one)."""
    p = case.problem
    cu = p.cu.tolist()
    log_probs = torch.log_softmax(logits, -1)
    rows, masks, sources = [], [], []
    width = max(b - a for a, b in zip(cu, cu[1:]))
    for i in range(len(cu) - 1):
        kept = [t for t in range(cu[i], cu[i + 1]) if int(p.targets[t]) != -100]
        lp = torch.stack([log_probs[t, int(p.targets[t])] for t in kept])
        rows.append(torch.cat([lp, lp.new_zeros(width - len(kept))]))
        masks.append(torch.arange(width) < len(kept))
        if bool(case.is_self[i]):
            sources.append(case.old.double()[kept].mean())
        elif not torch.isnan(case.gen_seq[i]):
            sources.append(case.gen_seq.double()[i] / int(case.gen_seq_tokens[i]))  # Trajectory.source_mean_logp
        else:
            sources.append(p.gen.double()[kept].mean())
    return torch.stack(rows), torch.stack(masks), torch.stack(sources)


CONFIGS = {
    "authors-defaults": dict(),
    "alpha-half-m3": dict(alpha=0.5, _m=3),
    "alpha-2-wide-delta": dict(alpha=2.0, cross_clip_delta=0.9, cross_clip_step=0.1, _m=1),
    "lower-bound-reaches-1": dict(cross_clip_step=0.1, _m=5),
    "log-ratio-clamped": dict(max_abs_log_ratio=0.05),
    "wide-self-clip": dict(self_clip_low=0.3, self_clip_high=0.1, alpha=0.0),
}


def _config(name: str) -> tuple[LossConfig, int]:
    options = {k: v for k, v in CONFIGS[name].items() if not k.startswith("_")}
    return LossConfig(method="hacpo", **options), CONFIGS[name].get("_m", 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_loss_and_its_gradients_equal_the_authors_code_in_float64(name, seed):
    cfg, m = _config(name)
    case = make_case(seed=seed * 31 + len(name))
    p = case.problem
    hidden, weight, bias = (t.clone().requires_grad_() for t in (p.hidden, p.weight, p.bias))
    out = ftis_kernels.fused_linear_ftis_loss(hidden, weight, p.targets, p.gen, p.adv, p.cu, bias=bias, config=cfg,
                                              backend="torch", **op_inputs(case, m))
    ours = torch.autograd.grad(out.loss, (hidden, weight, bias))
    hidden, weight, bias = (t.clone().requires_grad_() for t in (p.hidden, p.weight, p.bias))
    target, mask, source = authors_inputs(case, hidden @ weight.T + bias)
    theirs_loss = authors_loss(target, mask, source, p.adv.double(), case.is_self, case.capability.double(), m, cfg)
    theirs = torch.autograd.grad(theirs_loss, (hidden, weight, bias))

    assert out.loss.dtype == torch.float64
    assert abs(float(out.loss.detach()) - float(theirs_loss.detach())) <= 1e-12
    for a, b in zip(ours, theirs):
        assert float((a - b).abs().max()) <= 1e-12
    assert float(ours[0].abs().max()) > 1e-4  # a loss that moves the weights


def test_the_random_cases_reach_every_branch_of_the_authors_loss():
    """Guards the comparison above: across its seeds the clip of the self term, both bounds of the cross term and
    the log-ratio's clamp each take some sequence, and the lower bound reaches 1."""
    seen = set()
    for name in CONFIGS:
        cfg, m = _config(name)
        lower = min(1.0, 1.0 - cfg.cross_clip_delta + m * cfg.cross_clip_step)
        seen.add("lower is 1" if lower == 1.0 else "lower below 1")
        for seed in (0, 1, 2):
            case = make_case(seed=seed * 31 + len(name))
            target, mask, source = authors_inputs(case, case.problem.logits())
            x = (target * mask).sum(-1) / mask.sum(-1) - source
            ratio = x.clamp(-cfg.max_abs_log_ratio, cfg.max_abs_log_ratio).exp()
            cross = ~case.is_self
            if bool((x.abs() > cfg.max_abs_log_ratio).any()):
                seen.add("clamped")
            if bool((cross & (ratio < lower)).any()):
                seen.add("cross below")
            if bool((cross & (ratio > 1)).any()):
                seen.add("cross above")
            outside = (ratio < 1 - cfg.self_clip_low) | (ratio > 1 + cfg.self_clip_high)
            if bool((case.is_self & outside).any()):
                seen.add("self clipped")
    assert seen == {"lower is 1", "lower below 1", "clamped", "cross below", "cross above", "self clipped"}


def test_the_defaults_are_the_authors_config():
    cfg = LossConfig(method="hacpo")
    assert {k: getattr(cfg, k) for k in AUTHORS_DEFAULTS} == AUTHORS_DEFAULTS


@pytest.mark.parametrize("fused", [True, False], ids=["fused-linear", "logits"])
def test_both_backends_and_entry_points_give_the_same_loss_stats_and_gradients(fused):
    cfg, m = _config("alpha-half-m3")
    case = make_case(seed=7)
    p = case.problem
    results = {}
    for backend in ("torch", "triton"):
        if fused:
            hidden, weight = p.hidden.float().requires_grad_(), p.weight.float().requires_grad_()
            out = ftis_kernels.fused_linear_ftis_loss(hidden, weight, p.targets, p.gen, p.adv, p.cu, config=cfg,
                                                      backend=backend, **op_inputs(case, m))
            grads = torch.autograd.grad(out.loss, (hidden, weight))
        else:
            logits = (p.hidden @ p.weight.T).float().requires_grad_()
            out = ftis_kernels.ftis_loss(logits, p.targets, p.gen, p.adv, p.cu, config=cfg, backend=backend,
                                         **op_inputs(case, m))
            grads = torch.autograd.grad(out.loss, (logits,))
        results[backend] = out, grads
    (a, ga), (b, gb) = results["torch"], results["triton"]
    target, mask, source = authors_inputs(case, p.hidden @ p.weight.T)
    theirs = authors_loss(target, mask, source, p.adv.double(), case.is_self, case.capability.double(), m, cfg)
    assert float(a.loss.detach()) == pytest.approx(float(theirs), rel=1e-5)  # float32 against the float64 one
    assert float(b.loss.detach()) == pytest.approx(float(a.loss.detach()), rel=1e-5)
    for key in STAT_KEYS:
        assert float(b.stats[key]) == pytest.approx(float(a.stats[key]), rel=1e-5, abs=1e-6), key
    for x, y in zip(ga, gb):
        assert float((x - y).abs().max() / y.abs().max()) <= 1e-4


def test_clip_frac_counts_the_sequences_a_clip_took():
    """self: PPO's clipped branch strictly the smaller; cross: the ratio outside [lower, 1]."""
    cfg, m = _config("alpha-2-wide-delta")
    case = make_case(seed=3)
    p = case.problem
    out = ftis_kernels.fused_linear_ftis_loss(p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu, bias=p.bias,
                                              config=cfg, backend="torch", **op_inputs(case, m))
    target, mask, source = authors_inputs(case, p.logits())
    ratio = ((target * mask).sum(-1) / mask.sum(-1) - source).clamp(-10, 10).exp()
    adv = p.adv.double()
    lower = min(1.0, 1.0 - cfg.cross_clip_delta + m * cfg.cross_clip_step)
    took = torch.where(case.is_self, ratio.clamp(1 - cfg.self_clip_low, 1 + cfg.self_clip_high) * adv < ratio * adv,
                       (ratio < lower) | (ratio > 1))
    assert 0 < int(took.sum()) < took.numel()
    assert float(out.stats["clip_frac"]) == pytest.approx(float(took.double().mean()), abs=1e-12)
    assert int(out.stat_counts["clip_frac"]) == p.adv.numel()


def test_a_sequence_without_a_counted_token_adds_nothing_but_keeps_its_place():
    cfg, m = _config("authors-defaults")
    case = make_case(seed=11)
    p = case.problem
    cu = p.cu.tolist()
    empty = 3
    targets = p.targets.clone()
    targets[cu[empty]:cu[empty + 1]] = -100
    out = ftis_kernels.fused_linear_ftis_loss(p.hidden, p.weight, targets, p.gen, p.adv, p.cu, bias=p.bias,
                                              config=cfg, backend="torch", **op_inputs(case, m))
    target, mask, source = authors_inputs(case, p.logits())
    rest = torch.arange(p.adv.numel()) != empty
    theirs = authors_loss(target[rest], mask[rest], source[rest], p.adv.double()[rest], case.is_self[rest],
                          case.capability.double()[rest], m, cfg)
    assert float(out.loss) == pytest.approx(float(theirs) * (len(cu) - 2) / (len(cu) - 1), abs=1e-12)


def test_micro_batches_given_the_whole_batchs_sequence_count_add_up_to_one_call():
    cfg, m = _config("alpha-half-m3")
    case = make_case(seed=5)
    p = case.problem
    whole = ftis_kernels.fused_linear_ftis_loss(p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu, config=cfg,
                                                backend="torch", **op_inputs(case, m)).loss
    cu = p.cu.tolist()
    total = 0.0
    for part in (slice(0, 3), slice(3, 8)):
        rows = slice(cu[part.start], cu[part.stop])
        inputs = {k: (v[part] if k != "old_logprobs" else v[rows]) if torch.is_tensor(v) else v
                  for k, v in op_inputs(case, m).items()}
        total += float(ftis_kernels.fused_linear_ftis_loss(
            p.hidden[rows], p.weight, p.targets[rows], p.gen[rows], p.adv[part],
            p.cu[part.start:part.stop + 1] - cu[part.start], config=cfg, backend="torch", num_sequences=8,
            **inputs).loss)
    assert total == pytest.approx(float(whole), abs=1e-12)


@pytest.mark.parametrize("option, value", [("alpha", 2.0), ("cross_clip_step", 0.1), ("cross_clip_delta", 0.05),
                                           ("self_clip_high", 0.5), ("max_abs_log_ratio", 0.01)])
def test_each_option_changes_the_loss_of_the_cases_above(option, value):
    """Guards the comparisons: every option the authors' config names moves the loss of a random case (with m = 2)."""
    case = make_case(seed=2)
    p = case.problem
    losses = [float(ftis_kernels.fused_linear_ftis_loss(p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu,
                                                        backend="torch", method="hacpo", **options,
                                                        **op_inputs(case, 2)).loss)
              for options in ({}, {option: value})]
    assert losses[0] != pytest.approx(losses[1], rel=1e-9, abs=1e-12)


def test_the_inputs_change_the_loss_as_they_should():
    """A peer's capability ratio scales its cross term; the foreign token count is the divisor of its source mean;
    the learner's own sequences ignore c."""
    case = make_case(seed=4)
    p = case.problem
    cfg = LossConfig(method="hacpo", cross_clip_delta=1.0)

    def loss(**changes):
        return float(ftis_kernels.fused_linear_ftis_loss(p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu,
                                                         config=cfg, backend="torch",
                                                         **{**op_inputs(case, 0), **changes}).loss)

    base = loss()
    c = case.capability.clone()
    c[case.is_self] *= 7.0
    assert loss(capability_ratio=c) == base
    assert loss(capability_ratio=None) != pytest.approx(base, abs=1e-9)
    counts = case.gen_seq_tokens.clone()
    counts[~torch.isnan(case.gen_seq)] += 3
    assert loss(gen_seq_tokens=counts) != pytest.approx(base, abs=1e-9)


BAD_INPUTS = {
    "is_self missing": (dict(is_self=None), ValueError, "is_self: required by hacpo"),
    "is_self int": (dict(is_self=torch.zeros(8, dtype=torch.long)), TypeError, "is_self: expected a bool"),
    "is_self length": (dict(is_self=torch.zeros(3, dtype=torch.bool)), ValueError, r"is_self: expected shape \[8\]"),
    "is_self meta": (dict(is_self=torch.zeros(8, dtype=torch.bool, device="meta")), ValueError, "is_self: on meta"),
    "counts missing": (dict(gen_seq_tokens=None), ValueError, "gen_seq_tokens: required by hacpo"),
    "counts zero": (dict(gen_seq_tokens=torch.zeros(8, dtype=torch.int32)), ValueError, "gen_seq_tokens: must be >= 1"),
    "counts float": (dict(gen_seq_tokens=torch.ones(8)), TypeError, "gen_seq_tokens: expected an integer"),
    "capability zero": (dict(capability_ratio=torch.zeros(8)), ValueError, "capability_ratio: must be finite and > 0"),
    "capability nan": (dict(capability_ratio=torch.full((8,), float("nan"))), ValueError, "capability_ratio"),
    "capability inf": (dict(capability_ratio=torch.full((8,), float("inf"))), ValueError, "capability_ratio"),
    "capability int": (dict(capability_ratio=torch.ones(8, dtype=torch.long)), TypeError, "capability_ratio: dtype"),
    "index negative": (dict(mini_batch_index=-1), ValueError, "mini_batch_index: must be an int in"),
    "index huge": (dict(mini_batch_index=10**30), ValueError, "mini_batch_index: must be an int in"),
    "index bool": (dict(mini_batch_index=True), ValueError, "mini_batch_index"),
    "index float": (dict(mini_batch_index=1.0), ValueError, "mini_batch_index"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_hacpo_inputs_raise_naming_the_argument(case):
    changes, error, message = BAD_INPUTS[case]
    c = make_case(seed=1)
    p = c.problem
    with pytest.raises(error, match=message):
        ftis_kernels.fused_linear_ftis_loss(p.hidden.float(), p.weight.float(), p.targets, p.gen, p.adv, p.cu,
                                            backend="torch", method="hacpo", **{**op_inputs(c, 0), **changes})


@pytest.mark.parametrize("options, field", [
    (dict(self_clip_low=-0.1), "self_clip_low"), (dict(self_clip_low=1.5), "self_clip_low"),
    (dict(self_clip_high=float("inf")), "self_clip_high"), (dict(self_clip_high=-1e-3), "self_clip_high"),
    (dict(cross_clip_delta=1.2), "cross_clip_delta"), (dict(cross_clip_delta=float("nan")), "cross_clip_delta"),
    (dict(cross_clip_step=-0.1), "cross_clip_step"), (dict(alpha=-1.0), "alpha"), (dict(alpha=float("inf")), "alpha"),
    (dict(max_abs_log_ratio=0.0), "max_abs_log_ratio"), (dict(max_abs_log_ratio=21.0), "max_abs_log_ratio"),
    (dict(method="hacpo", normalization="token"), "normalization"), (dict(method="hacpo", beta=0.1), "beta"),
    (dict(method="hacpo", entropy_coef=0.1), "entropy_coef"), (dict(method="hacpo", delta=2.0), "delta"),
    (dict(method="hacpo", dual_clip=3.0), "dual_clip"), (dict(method="hacpo", ratio_level="sequence"), "ratio_level"),
    (dict(method="hacpo", policy_loss="cispo"), "policy_loss"),
    (dict(method="hacpo", reject="token", reject_max=1.0), "reject"),
])
def test_bad_hacpo_options_raise_naming_the_field(options, field):
    with pytest.raises(ValueError, match=rf"^LossConfig\.{field}: "):
        LossConfig(**options)


def test_the_other_methods_read_none_of_hacpos_inputs():
    case = make_case(seed=6)
    p = case.problem
    args = (p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu)
    plain = ftis_kernels.fused_linear_ftis_loss(*args, backend="torch", gen_seq_logprobs=case.gen_seq,
                                                old_logprobs=case.old)
    given = ftis_kernels.fused_linear_ftis_loss(*args, backend="torch", **op_inputs(case, 4))
    assert float(given.loss) == float(plain.loss)


def test_on_the_learners_own_rollouts_hacpo_is_the_sequence_level_ratio_of_nois():
    """The authors' self term is GSPO's sequence ratio: nois with ratio_level sequence, its clip the self clip."""
    case = make_case(seed=9)
    p = case.problem
    args = (p.hidden, p.weight, p.targets, p.gen, p.adv, p.cu)
    everyone = torch.ones(p.adv.numel(), dtype=torch.bool)
    hacpo = ftis_kernels.fused_linear_ftis_loss(*args, backend="torch", method="hacpo", self_clip_low=0.05,
                                                self_clip_high=0.02, max_abs_log_ratio=20.0, is_self=everyone,
                                                old_logprobs=case.old)
    gspo = ftis_kernels.fused_linear_ftis_loss(*args, backend="torch", method="nois", ratio_level="sequence",
                                               eps_low=0.05, eps_high=0.02, old_logprobs=case.old)
    assert abs(float(hacpo.loss) - float(gspo.loss)) <= 1e-12 and float(hacpo.loss) != 0.0
