"""Each peer's off-policy correction, written here from the peer's documented definition on padded [B, T]
tensors as the peer computes it, against the LossConfig that README's peer table maps it to (SPEC 2b).

TRL: GRPOTrainer's loss (trl/trainer/grpo_trainer.py, GRPOConfig docs): vLLM importance sampling
(`vllm_importance_sampling_mode` token_truncate | token_mask | sequence_truncate | sequence_mask, clip min / max,
the ratio pi_old / pi_vllm), the off-policy sequence mask (`off_policy_mask_threshold`), `delta`,
`importance_sampling_level="sequence"` (GSPO), `loss_type="cispo"`, and loss types grpo | bnpo | dr_grpo | dapo.
verl: rollout correction (docs/algo/rollout_corr.md: `rollout_is` token | sequence with `rollout_is_threshold`,
`rollout_rs` token_k* | seq_sum_k* | seq_mean_k* | seq_max_k* with `rollout_rs_threshold`), the vanilla policy loss
with dual clip `clip_ratio_c`, and `agg_loss` token-mean | seq-mean-token-mean. Liger: `delta` in its GRPO loss.
Everything in float64; loss and the gradient of the logits must agree to 1e-12.
"""

from __future__ import annotations

import math

import ftis_kernels
import pytest
import torch
from ftis_kernels import LossConfig

B, T, V = 6, 9, 11


def _problem(seed: int, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.tensor([T, 3, 7, 5, T, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = torch.clamp(logp + spread * 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64), max=-1e-3)
    sampling = torch.clamp(old + spread * torch.randn(B, T, generator=gen, dtype=torch.float64), max=-1e-3)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.1, -0.3, 0.9], dtype=torch.float64)
    return dict(logits=logits, ids=ids, mask=mask, old=old.detach(), sampling=sampling.detach(), adv=adv)


def _logps(p, logits):
    return torch.log_softmax(logits, -1).gather(-1, p["ids"][..., None])[..., 0]


def ours(p, cfg: LossConfig, with_old: bool = True, num_tokens: int | None = None, num_sequences: int | None = None):
    """Our op on the same problem, packed: (loss, d loss / d logits [B, T, V], the LossOutput)."""
    logits = p["logits"].clone().requires_grad_()
    keep = p["mask"].bool()
    lengths = keep.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    out = ftis_kernels.ftis_loss(
        logits[keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu, config=cfg, backend="torch",
        old_logprobs=p["old"][keep] if with_old else None, num_tokens=num_tokens, num_sequences=num_sequences,
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out.loss.detach(), grad, out


def peer(p, fn, **kwargs):
    logits = p["logits"].clone().requires_grad_()
    loss = fn(p, _logps(p, logits), **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def assert_same(a, b, rel=1e-12):
    (loss_a, grad_a), (loss_b, grad_b) = a[:2], b[:2]
    assert float(loss_a) == pytest.approx(float(loss_b), rel=rel, abs=1e-14)
    torch.testing.assert_close(grad_a, grad_b, rtol=rel, atol=1e-14)


# ------------------------------------------------------------------------------------------------------- TRL


def trl_loss(p, logps, *, loss_type="grpo", eps_low=0.2, eps_high=0.2, delta=None, is_mode=None, is_min=None,
             is_max=3.0, level="token", opsm=None, max_completion_length=T):
    """GRPOTrainer: per_token_loss from coef_1 = pi / pi_old, times the OPSM mask and the vLLM IS ratio."""
    mask, adv = p["mask"], p["adv"][:, None]
    old, sampling = p["old"], p["sampling"]
    ratio_is = None
    if is_mode is not None:  # computed once at generation: pi_old / pi_vllm, truncated or masked
        diff = (old - sampling) * mask
        log_w = diff.sum(-1, keepdim=True) if is_mode.startswith("sequence") else diff
        ratio_is = torch.exp(log_w)
        if is_mode.endswith("truncate"):
            ratio_is = torch.clamp(ratio_is, min=is_min, max=is_max)
        else:
            lo = -math.inf if is_min is None else is_min
            ratio_is = ratio_is.masked_fill((ratio_is < lo) | (ratio_is > is_max), 0.0)
    if opsm is not None:  # keep if A >= 0 or mean_t(log pi_vllm - log pi) <= delta
        seq_kl = ((sampling - logps.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        off_policy_mask = ((adv >= 0) | (seq_kl <= opsm)).double()
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_ratio)
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if opsm is not None:
        per_token = per_token * off_policy_mask
    if ratio_is is not None:
        per_token = per_token * ratio_is
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "cispo"):  # dapo / cispo: / num_items_in_batch, one process
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    assert loss_type == "dr_grpo"
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


NORM = {"grpo": "sequence", "bnpo": "token", "dapo": "token", "dr_grpo": "constant"}


@pytest.mark.parametrize("mode, loss_type, is_min", [
    ("token_truncate", "dapo", None), ("token_truncate", "grpo", 0.5), ("token_mask", "grpo", 0.6),
    ("sequence_truncate", "bnpo", None), ("sequence_mask", "dr_grpo", None), ("sequence_mask", "dapo", 0.2),
])
def test_trl_vllm_importance_sampling_modes(mode, loss_type, is_min):
    """TRL vllm_importance_sampling_mode (default sequence_mask, cap 3): tis with is_source=old."""
    p = _problem(1)
    level, how = mode.split("_")
    cfg = LossConfig(method="tis", is_source="old", is_level=level, is_mode=how, is_cap=3.0, is_min=is_min,
                     normalization=NORM[loss_type], norm_max_len=T)
    reference = peer(p, trl_loss, loss_type=loss_type, is_mode=mode, is_min=is_min, is_max=3.0)
    result = ours(p, cfg)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["is_truncated_frac"]) < 1  # the cap and floor act on this problem


@pytest.mark.parametrize("with_is", [False, True], ids=["opsm", "opsm-with-vllm-is"])
def test_trl_off_policy_sequence_mask(with_is):
    """TRL off_policy_mask_threshold (DeepSeek-V3.2 OPSM) is our filter with kl_estimator k1-gen, kl_reduction
    mean and kl_threshold delta: a sequence with A < 0 and mean_t(log pi_gen - log pi) > delta adds nothing and
    keeps its place in the normaliser. (At A = 0 the term is 0 either way; a KL exactly at delta, TRL keeps.)"""
    p = _problem(2, spread=1.0)
    delta = 0.5
    method = "f-tis" if with_is else "f-nois"
    cfg = LossConfig(method=method, is_source="old", is_level="sequence", is_mode="mask", is_cap=3.0,
                     kl_estimator="k1-gen", kl_reduction="mean", kl_threshold=delta)
    reference = peer(p, trl_loss, opsm=delta, is_mode="sequence_mask" if with_is else None)
    result = ours(p, cfg)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["filtered_frac"]) < 0.5  # some negative-advantage sequences masked


@pytest.mark.parametrize("peer_name", ["TRL", "Liger"])
def test_trl_and_liger_two_sided_clip_delta(peer_name):
    """TRL GRPOConfig.delta and Liger's GRPO loss `delta` (INTELLECT-2): the same formula in both."""
    p = _problem(3, spread=1.2)
    cfg = LossConfig(method="nois", delta=1.4, eps_high=0.28)
    reference = peer(p, trl_loss, delta=1.4, eps_high=0.28)
    result = ours(p, cfg)
    assert_same(result, reference)
    without = ours(p, cfg.replace(delta=None))
    assert abs(float(without[0]) - float(result[0])) > 1e-6  # delta binds on this problem


def test_trl_gspo_sequence_level_ratio():
    """TRL importance_sampling_level="sequence" (GSPO, with its small clip range), loss_type grpo."""
    p = _problem(4, spread=0.01)
    cfg = LossConfig(method="nois", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4)
    reference = peer(p, trl_loss, level="sequence", eps_low=3e-4, eps_high=4e-4)
    result = ours(p, cfg)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["clip_frac"]) < 1


def test_trl_cispo():
    """TRL loss_type="cispo": -sg(min(r, epsilon_high)) A log pi over the batch's tokens; ours with the same
    upper bound (eps_high = epsilon_high - 1) and no lower clip (eps_low = 1)."""
    p = _problem(5, spread=1.0)
    cfg = LossConfig(method="nois", policy_loss="cispo", eps_low=1.0, eps_high=0.3, normalization="token")
    reference = peer(p, trl_loss, loss_type="cispo", eps_high=1.3)
    result = ours(p, cfg)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["clip_frac"]) < 1


def test_trl_cispo_with_its_default_epsilon_high_below_one():
    """TRL's CISPO falls back to epsilon = 0.2 when epsilon_high is unset: the weight min(r, 0.2), a cap below 1.
    Ours: eps_high = 0.2 - 1 = -0.8 (allowed for cispo, whose cap is not a trust region), eps_low = 1."""
    p = _problem(5, spread=1.0)
    cfg = LossConfig(method="nois", policy_loss="cispo", eps_low=1.0, eps_high=-0.8, normalization="token")
    assert_same(ours(p, cfg), peer(p, trl_loss, loss_type="cispo", eps_high=0.2))
    with pytest.raises(ValueError, match="LossConfig.eps_high: cispo's cap"):
        LossConfig(policy_loss="cispo", eps_low=0.2, eps_high=-0.5)  # a cap below the floor 1 - eps_low
    with pytest.raises(ValueError, match="LossConfig.eps_high: must be a finite number >= 0"):
        LossConfig(eps_high=-0.8)  # PPO's clip range stays a range around 1


# ------------------------------------------------------------------------------------------------------ verl

VERL_K = {"k1": "k1-gen", "k2": "k2", "k3": "k3-gen"}  # verl's per-token terms on log(pi_old / pi_rollout)


def verl_loss(p, logps, *, rollout_is=None, is_threshold=2.0, rollout_rs=None, rs_threshold=None,
              clip_ratio=0.2, clip_ratio_c=3.0, agg="token-mean", trainer=False):
    """verl decoupled mode: IS weights (on the response mask before rejection, rollout_corr_helper) and the
    rejection mask from old vs rollout log-probs, then the vanilla PPO loss with dual clip, times the weights,
    aggregated over the rejection-modified response mask. trainer: seq-mean-token-mean divides by the trainer's
    global batch size (ppo_mini_batch_size * rollout.n: every sequence, emptied ones included, ray_trainer.py)
    instead of the sequences left, as a standalone agg_loss call does."""
    mask, adv = p["mask"], p["adv"][:, None]
    log_ratio = p["old"] - p["sampling"]
    weights = None
    if rollout_is is not None:
        if rollout_is == "sequence":
            log_w = torch.clamp((log_ratio * mask).sum(-1, keepdim=True), -20, 20).expand_as(log_ratio)
        else:
            log_w = torch.clamp(log_ratio, -20, 20)
        weights = (torch.exp(log_w) * mask).clamp(max=is_threshold)
    if rollout_rs is not None:
        x = torch.clamp(log_ratio, -20, 20)
        terms = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}[rollout_rs[-2:]]
        if rollout_rs.startswith("token"):
            stat = terms
        elif rollout_rs.startswith("seq_sum"):
            stat = (terms * mask).sum(-1, keepdim=True)
        elif rollout_rs.startswith("seq_mean"):
            stat = ((terms * mask).sum(-1) / mask.sum(-1))[:, None]
        else:
            stat = terms.masked_fill(mask == 0, -math.inf).max(-1, keepdim=True).values
        if rollout_rs.endswith("k1"):
            lower, upper = (float(v) for v in rs_threshold.split("_"))
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep = stat <= rs_threshold
        mask = mask * keep.expand_as(mask).double()
    ratio = torch.exp(torch.clamp(logps - p["old"], -20, 20))
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clipped1 = torch.maximum(losses1, losses2)
    clipped2 = torch.min(-adv * clip_ratio_c, clipped1)
    losses = torch.where(adv < 0, clipped2, clipped1)
    if weights is not None:
        losses = losses * weights
    if agg == "token-mean":
        return (losses * mask).sum() / mask.sum()
    per_seq_tokens = mask.sum(-1)
    seq_losses = (losses * mask).sum(-1) / (per_seq_tokens + 1e-8)  # verl's epsilon
    if trainer:
        return seq_losses.sum() / per_seq_tokens.numel()
    live = (per_seq_tokens > 0).double()
    return (seq_losses * live).sum() / live.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_rollout_importance_sampling(level):
    """verl rollout_is token | sequence (truncated at rollout_is_threshold, weight pi_old / pi_rollout) with the
    vanilla loss (dual clip c = 3) and token-mean: tis, is_source old, dual_clip 3, token normalisation."""
    p = _problem(6, spread=0.4)
    cfg = LossConfig(method="tis", is_source="old", is_level=level, is_cap=2.0, dual_clip=3.0,
                     normalization="token")
    reference = peer(p, verl_loss, rollout_is=level, is_threshold=2.0)
    result = ours(p, cfg)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["is_truncated_frac"]) < 1


@pytest.mark.parametrize("option, threshold, agg", [
    ("token_k1", "0.6_1.5", "token-mean"), ("seq_sum_k2", 1.0, "seq-mean-token-mean"),
    ("seq_mean_k3", 0.12, "token-mean"), ("seq_max_k3", 0.4, "seq-mean-token-mean"),
    ("seq_mean_k1", "0.8_1.3", "seq-mean-token-mean"),
])
def test_verl_rejection_sampling(option, threshold, agg):
    """verl rollout_rs: blind to A, a rejected token or sequence leaves the response mask and so every
    normaliser (a sequence emptied by it leaves seq-mean's count). Ours: reject with reject_estimator k1-gen / k2 /
    k3-gen; verl's k1 bounds lower_upper are ratios, ours their logs."""
    p = _problem(7, spread=0.5)
    level = "token" if option.startswith("token") else option.split("_")[1]
    if option.endswith("k1"):
        lower, upper = (float(v) for v in threshold.split("_"))
        bounds = dict(reject_min=math.log(lower), reject_max=math.log(upper))
    else:
        bounds = dict(reject_max=threshold)
    cfg = LossConfig(method="tis", is_source="old", is_level="token", is_cap=2.0, dual_clip=3.0,
                     reject=level, reject_estimator=VERL_K[option[-2:]], **bounds,
                     normalization="token" if agg == "token-mean" else "sequence")
    reference = peer(p, verl_loss, rollout_is="token", rollout_rs=option, rs_threshold=threshold, agg=agg)
    result = ours(p, cfg)
    # verl's seq-mean-token-mean divides a sequence's sum by (its tokens + 1e-8): ~1e-8 of each term, more of a
    # loss whose terms cancel
    assert_same(result, reference, rel=1e-12 if agg == "token-mean" else 1e-6)
    assert 0 < float(result[2].stats["rejected_frac"]) < 0.8  # the threshold binds, something is left
    if level != "token":
        assert float(result[2].stats["rejected_seq_frac"]) > 0


def test_verl_trainer_divides_seq_mean_by_every_sequence_of_the_batch():
    """verl's trainer passes agg_loss its global batch size, so under seq-mean-token-mean a sequence that rejection
    emptied stays in the divisor: ours given num_sequences = the batch's sequences (no rejection_scale). A
    standalone agg_loss divides by the sequences left: ours by default (test_verl_rejection_sampling)."""
    p = _problem(7, spread=0.5)
    cfg = LossConfig(method="tis", is_source="old", is_cap=2.0, dual_clip=3.0, reject="sum", reject_estimator="k2",
                     reject_max=1.0, normalization="sequence")
    reference = peer(p, verl_loss, rollout_is="token", rollout_rs="seq_sum_k2", rs_threshold=1.0,
                     agg="seq-mean-token-mean", trainer=True)
    result = ours(p, cfg, num_sequences=B)
    assert_same(result, reference, rel=1e-6)  # verl's 1e-8 in each sequence's token count
    assert float(result[2].stats["rejected_seq_frac"]) > 0  # an emptied sequence makes the two divisors differ
    assert float(ours(p, cfg)[0]) != pytest.approx(float(reference[0]), rel=1e-3)


def test_verl_sequence_is_weight_counts_the_tokens_rejection_drops_with_is_tokens_all():
    """verl computes a sequence IS weight on the response mask from before rejection: a token rejection leaves
    the rejected tokens' log-ratios in their sequence's weight. Ours: is_tokens all (default kept: only kept
    tokens enter the weight)."""
    p = _problem(9, spread=0.5)
    common = dict(method="tis", is_source="old", is_level="sequence", is_cap=2.0, dual_clip=3.0, reject="token",
                  reject_estimator="k1-gen", reject_min=math.log(0.7), reject_max=math.log(1.4),
                  normalization="token")
    reference = peer(p, verl_loss, rollout_is="sequence", rollout_rs="token_k1", rs_threshold="0.7_1.4")
    result = ours(p, LossConfig(**common, is_tokens="all"))
    assert_same(result, reference)
    assert 0 < float(result[2].stats["rejected_frac"]) < 0.8
    kept = ours(p, LossConfig(**common))  # the default weighs sequences by their kept tokens only
    assert float(kept[0]) != pytest.approx(float(reference[0]), rel=1e-3)


# -------------------------------------------------------------------------------------------------- prime-rl


def prime_rl_loss(p, logps, *, mask_low=0.5, mask_high=2.0, loss_scale=None):
    """prime-rl compute_loss (token ratio, kl_tau 0, no sequence mask): -r A over the tokens whose ratio
    r = pi / pi_inference lies in [mask_ratio_low, mask_ratio_high], summed, divided by loss_scale."""
    mask = p["mask"].bool()
    ratio = torch.exp(logps - p["sampling"])
    keep = mask & (ratio >= mask_low) & (ratio <= mask_high)
    return (-ratio * p["adv"][:, None])[keep].sum() / loss_scale


def test_prime_rl_masked_token_ratio():
    """prime-rl's loss: vis without a clip (eps_low 1, eps_high huge), its ratio mask as a token rejection on
    x = g - l (k1-gen: reject_min = -log(mask_ratio_high), reject_max = -log(mask_ratio_low)), and its
    loss_scale, the batch's tokens before masking, as the num_tokens of token normalisation."""
    p = _problem(8, spread=0.5)
    tokens = int(p["mask"].sum())
    cfg = LossConfig(method="vis", eps_low=1.0, eps_high=1e9, reject="token", reject_estimator="k1-gen",
                     reject_min=-math.log(2.0), reject_max=-math.log(0.5), normalization="token")
    reference = peer(p, prime_rl_loss, loss_scale=tokens)
    result = ours(p, cfg, with_old=False, num_tokens=tokens)
    assert_same(result, reference)
    assert 0 < float(result[2].stats["rejected_frac"]) < 0.8


# ------------------------------------------------------------------------------------------------- KL to a reference


def _with_reference(p, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logp = _logps(p, p["logits"])
    p["ref"] = torch.clamp(logp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64), max=-1e-3).detach()
    return p


def ours_with_reference(p, cfg: LossConfig):
    logits = p["logits"].clone().requires_grad_()
    keep = p["mask"].bool()
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(keep.sum(1), 0)
    out = ftis_kernels.ftis_loss(logits[keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu, config=cfg,
                                 backend="torch", old_logprobs=p["old"][keep], ref_logprobs=p["ref"][keep])
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out.loss.detach(), grad, out


def trl_with_beta(p, logps, *, beta):
    """GRPOTrainer with beta > 0: per_token_kl = exp(ref - logp) - (ref - logp) - 1, per_token_loss = -(min(...)
    - beta * per_token_kl), loss_type grpo."""
    mask, adv = p["mask"], p["adv"][:, None]
    coef_1 = torch.exp(logps - p["old"])
    per_token = -torch.min(coef_1 * adv, torch.clamp(coef_1, 0.8, 1.2) * adv)
    per_token_kl = torch.exp(p["ref"] - logps) - (p["ref"] - logps) - 1
    per_token = per_token + beta * per_token_kl
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def verl_kl_loss(p, logps, *, coef, kind):
    """verl's actor: pg_loss (vanilla, token-mean) + kl_loss_coef * agg_loss(kl_penalty(logp, ref, kind))."""
    mask, adv = p["mask"], p["adv"][:, None]
    ratio = torch.exp(logps - p["old"])
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    kl = {"low_var_kl": lambda d: torch.exp(-d) + d - 1,  # d = logp - ref: ratio = exp(ref - logp)
          "mse": lambda d: 0.5 * d * d, "kl": lambda d: d}[kind](logps - p["ref"])
    token_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    return token_mean(pg) + coef * token_mean(kl)


@pytest.mark.parametrize("beta", [0.04, 0.5])
def test_trls_beta_term_is_beta_with_the_k3_reference_kl(beta):
    p = _with_reference(_problem(3))
    result = ours_with_reference(p, LossConfig(method="nois", beta=beta))
    assert_same(result, peer(p, trl_with_beta, beta=beta))
    assert float(result[2].stats["ref_kl_mean"]) > 0


@pytest.mark.parametrize("kind, estimator", [("low_var_kl", "k3"), ("mse", "k2"), ("kl", "k1")])
def test_verls_kl_loss_is_beta_with_its_estimator_under_token_mean(kind, estimator):
    p = _with_reference(_problem(5))
    cfg = LossConfig(method="nois", beta=0.1, ref_kl_estimator=estimator, normalization="token")
    assert_same(ours_with_reference(p, cfg), peer(p, verl_kl_loss, coef=0.1, kind=kind))


def verl_entropy_loss(p, logps, *, coef, entropy):
    """verl's actor with entropy_coeff: pg_loss (vanilla, token-mean) - entropy_coeff * agg_loss(entropy)."""
    mask, adv = p["mask"], p["adv"][:, None]
    ratio = torch.exp(logps - p["old"])
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    token_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    return token_mean(pg) - coef * token_mean(entropy)


@pytest.mark.parametrize("coef", [0.001, 0.05])
def test_verls_entropy_coeff_is_entropy_coef_under_token_mean(coef):
    """verl computes the entropy from its logits (entropy_from_logits) and subtracts coef times its token mean; the
    gradient flows through it. Both losses and their logits' gradients agree."""
    p = _problem(6)
    logits = p["logits"].clone().requires_grad_()
    logp_all = torch.log_softmax(logits, -1)
    logps = logp_all.gather(-1, p["ids"][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    theirs = verl_entropy_loss(p, logps, coef=coef, entropy=entropy)
    (their_grad,) = torch.autograd.grad(theirs, logits)
    cfg = LossConfig(method="nois", entropy_coef=coef, normalization="token")
    keep = p["mask"].bool()
    ours_logits = p["logits"].clone().requires_grad_()
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(keep.sum(1), 0)
    out = ftis_kernels.ftis_loss(ours_logits[keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu, config=cfg,
                                 backend="torch", old_logprobs=p["old"][keep])
    (our_grad,) = torch.autograd.grad(out.loss, ours_logits)
    assert float(out.loss) == pytest.approx(float(theirs), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-10, atol=1e-12)
    without = ftis_kernels.ftis_loss(p["logits"][keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu,
                                     config=cfg.replace(entropy_coef=0.0), backend="torch",
                                     old_logprobs=p["old"][keep])
    assert float(out.loss) < float(without.loss)  # a bonus: more entropy, lower loss


def test_entropy_coef_with_gepo_or_not_finite_is_refused():
    with pytest.raises(ValueError, match=r"LossConfig.entropy_coef: gepo"):
        LossConfig(method="gepo", entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"LossConfig.entropy_coef: must be a finite number"):
        LossConfig(entropy_coef=float("inf"))


def test_beta_without_the_references_log_probs_or_with_gepo_is_refused():
    p = _problem(3)
    keep = p["mask"].bool()
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(keep.sum(1), 0)
    with pytest.raises(ValueError, match=r"^ref_logprobs: required when beta=0.1 > 0"):
        ftis_kernels.ftis_loss(p["logits"][keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu, beta=0.1)
    with pytest.raises(ValueError, match=r"^ref_logprobs: log-probabilities must be <= 0"):
        ftis_kernels.ftis_loss(p["logits"][keep], p["ids"][keep], p["sampling"][keep], p["adv"], cu, beta=0.1,
                               ref_logprobs=torch.ones(int(keep.sum()), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"LossConfig.beta: gepo"):
        LossConfig(method="gepo", beta=0.1)
