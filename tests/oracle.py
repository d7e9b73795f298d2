"""A float64 oracle of the loss, written from the formulas of docs/algorithm.md (and GEPO's paper, arXiv 2508.17850:
its group expectation E_q[q]), one completion at a time.

Deliberately naive and shaped unlike the op (kernels/ftis_kernels/objective/): it materialises the full
log_softmax, walks each completion's tokens in Python with scalar floats, and writes each method's term out whole
for one token. It shares no code with the op. Whether a clip took a term is read from autograd (the term's
gradient with respect to the ratio is zero), not from a predicate.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

BOUND = 20.0  # every log-ratio is clamped to [-BOUND, BOUND] before exp


def _clamp(x: float) -> float:
    return max(-BOUND, min(BOUND, x))


def _kl(x: float, estimator: str) -> float:
    """One token's KL estimate from x (clamped): KL(pi_theta || pi_gen) k1 -x, k2 x^2/2, k3 e^x - x - 1;
    KL(pi_gen || pi_theta) k1-gen x, k3-gen e^-x - 1 + x."""
    x = _clamp(x)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x * x / 2
    if estimator == "k3":
        return math.exp(x) - x - 1
    if estimator == "k1-gen":
        return x
    return math.exp(-x) - 1 + x  # k3-gen


def _ppo(r: torch.Tensor, a: float, cfg) -> torch.Tensor:
    """min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A), and max(that, c A) for A < 0 (dual clip c)."""
    unclipped = (r if cfg.delta is None else torch.clamp(r, max=cfg.delta)) * a
    term = torch.minimum(unclipped, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    if cfg.dual_clip is not None and a < 0:
        term = torch.maximum(term, torch.tensor(cfg.dual_clip * a, dtype=torch.float64))
    return term


def _ppo_clipped(r: float, a: float, cfg) -> bool:
    """A clip took PPO's term at ratio r: its derivative in r is zero (for a nonzero advantage)."""
    if a == 0:
        return False
    leaf = torch.tensor(r, dtype=torch.float64, requires_grad=True)
    (slope,) = torch.autograd.grad(_ppo(leaf, a, cfg), leaf)
    return float(slope) == 0.0


def _completion(rows, lp, targets, gen, old, gen_seq_i, cfg):
    """Everything about one completion that needs no other completion: its tokens before and after rejection,
    their log-probs (l with gradient), generation, old and numerator log-probs, and its rejection statistic."""
    given = [t for t in rows if int(targets[t]) != cfg.ignore_index]
    c = SimpleNamespace(given=given, l={}, g={}, o={}, n={}, stats=[], kept=list(given))
    for t in given:
        c.l[t] = lp[t, int(targets[t])]
        lb = float(c.l[t].detach())
        c.o[t] = float(old[t]) if old is not None else lb
        c.n[t] = c.o[t] if cfg.is_source == "old" else lb
        c.g[t] = float(gen[t])
    if given and gen_seq_i is not None and not math.isnan(gen_seq_i):
        # only log pi_gen(y) = G_i is known: log(pi/pi_gen) = (sum_t n_t - G_i) spread evenly over the tokens
        per_token = (sum(c.n.values()) - gen_seq_i) / len(given)
        c.g = {t: c.n[t] - per_token for t in given}
    if cfg.reject != "none" and given:
        d = {t: _kl(c.g[t] - c.n[t], cfg.reject_estimator) for t in given}
        if cfg.reject == "token":
            c.stats = [d[t] for t in given]
            verdict = d
        else:
            value = {"sum": sum(d.values()), "mean": sum(d.values()) / len(d), "max": max(d.values())}[cfg.reject]
            c.stats = [value]
            verdict = dict.fromkeys(given, value)
        low = -math.inf if cfg.reject_min is None else cfg.reject_min
        c.kept = [t for t in given if low <= verdict[t] <= cfg.reject_max]
    c.emptied = bool(given) and not c.kept
    return c


def _weights(c, cfg) -> tuple[dict, dict]:
    """Each kept token's IS weight w_t and whether its raw weight left [is_min or 0, C]."""
    over = c.given if (cfg.is_tokens == "all" and cfg.reject != "none") else c.kept
    log_w = {t: c.n[t] - c.g[t] for t in c.kept}
    if cfg.is_level == "sequence":
        log_w = dict.fromkeys(c.kept, sum(c.n[t] - c.g[t] for t in over))
    elif cfg.is_level == "geometric":
        log_w = dict.fromkeys(c.kept, sum(c.n[t] - c.g[t] for t in over) / max(len(over), 1))
    low, weights, outside = cfg.is_min or 0.0, {}, {}
    for t, x in log_w.items():
        raw = math.exp(_clamp(x))
        outside[t] = raw > cfg.is_cap or raw < low
        if cfg.is_mode == "mask":
            weights[t] = 0.0 if outside[t] else raw
        else:
            weights[t] = min(cfg.is_cap, max(low, raw))
    return weights, outside


def _token_method_sum(c, a, weights, entropy, ref_lp, cfg):
    """(sum_t u_t over the completion's kept tokens, how many a clip took) for nois, vis and tis."""
    method = cfg.method.removeprefix("f-")
    against = c.g if method == "vis" else c.o  # r_t = pi_theta / pi_gen (vis) or pi_theta / pi_old
    gspo = None
    if cfg.ratio_level == "sequence":  # GSPO: the sequence's geometric-mean ratio for every token
        gspo = torch.exp(torch.clamp(sum(c.l[t] - against[t] for t in c.kept) / len(c.kept), -BOUND, BOUND))
    total, clipped = torch.zeros((), dtype=torch.float64), 0
    for t in c.kept:
        r = gspo if gspo is not None else torch.exp(torch.clamp(c.l[t] - against[t], -BOUND, BOUND))
        if cfg.policy_loss == "cispo":
            u = torch.clamp(r.detach(), 1 - cfg.eps_low, 1 + cfg.eps_high) * a * c.l[t]
            clipped += not 1 - cfg.eps_low <= float(r.detach()) <= 1 + cfg.eps_high
        else:
            u = _ppo(r, a, cfg)
            clipped += _ppo_clipped(float(r.detach()), a, cfg)
        if method == "tis":
            u = weights[t] * u
        if ref_lp is not None and cfg.beta > 0:
            u = u - cfg.beta * _ref_kl(float(ref_lp[t]) - c.l[t], cfg.ref_kl_estimator)
        if cfg.entropy_coef != 0:
            u = u + cfg.entropy_coef * entropy[t]
        total = total + u
    return total, clipped


def _ref_kl(x, estimator: str):
    """KL to the reference from x = ref_t - l_t (a tensor with l's gradient, or a float), x clamped."""
    x = torch.clamp(torch.as_tensor(x, dtype=torch.float64), -BOUND, BOUND)
    return {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - x - 1}[estimator]


def _gepo_terms(seqs, advantage, group_ids, cfg):
    """GEPO: u_i = PPO(s_i / E_k[q], A_i), s_i = exp(mean_t l_t), q_i = exp(mean_t g_t), E_k[q] = sum_j p_j q_j with
    p_j = q_j / sum q over group k (its completions with a kept token). Returns (sum_i u_i, clipped count)."""
    groups = [0] * len(seqs) if group_ids is None else [int(k) for k in group_ids]
    q = {i: math.exp(sum(c.g[t] for t in c.kept) / len(c.kept)) for i, c in enumerate(seqs) if c.kept}
    total, clipped = torch.zeros((), dtype=torch.float64), 0
    for i, c in enumerate(seqs):
        if not c.kept:
            continue
        peers = [q[j] for j in q if groups[j] == groups[i]]
        expectation = sum(qj / sum(peers) * qj for qj in peers)
        mean_l = sum(c.l[t] for t in c.kept) / len(c.kept)
        s = torch.exp(torch.clamp(mean_l - math.log(expectation), -BOUND, BOUND))
        total = total + _ppo(s, advantage[i], cfg)
        clipped += _ppo_clipped(float(s.detach()), advantage[i], cfg)
    return total, clipped


def oracle(logits, targets, gen, adv, cu, cfg, old=None, group_ids=None, gen_seq=None, ref_lp=None):
    """(loss, logprobs [N], stats): `logits` a float64 [N, V] tensor (may require grad); gen, old, ref_lp [N];
    adv [S]; cu [S+1]; gen_seq [S] (NaN, or a completion's generation log-probability). stats: the op's STAT_KEYS
    as floats, and "_reject_statistics", the rejection statistic of each token (reject token) or completion.
    Not hacpo: tests/test_hacpo.py checks it against its authors' code."""
    if cfg.method == "hacpo":
        raise NotImplementedError("the oracle has no hacpo; tests/test_hacpo.py transcribes its authors' loss")
    lp = torch.log_softmax(logits.double() / cfg.temperature, dim=-1)
    entropy = -(lp.exp() * lp).sum(-1)  # differentiable, for the entropy bonus
    cu = [int(x) for x in cu]
    seqs = [_completion(range(cu[i], cu[i + 1]), lp, targets, gen.double(), old,
                        None if gen_seq is None else float(gen_seq[i]), cfg) for i in range(len(cu) - 1)]
    s_count = len(seqs)
    live = s_count - sum(c.emptied for c in seqs) if cfg.reject != "none" else s_count
    kept_tokens = sum(len(c.kept) for c in seqs)
    acc = SimpleNamespace(kl=0.0, filtered=0, w=0.0, out=0, clipped=0, ref_kl=0.0, a=[])
    per_completion = []  # (sum_t u_t, |a_i|)
    for c, a in zip(seqs, adv.double().tolist()):
        kl = sum(_kl(c.g[t] - float(c.l[t].detach()), cfg.kl_estimator) for t in c.kept)
        if cfg.kl_reduction == "mean":
            kl /= max(len(c.kept), 1)
        elif cfg.kl_reduction == "padded_mean":
            kl /= cfg.kl_max_len
        filtered = cfg.method.startswith("f-") and bool(c.kept) and a <= 0 and kl >= cfg.kl_threshold
        a = 0.0 if filtered else a  # the F-TIS filter: the completion stays in the normaliser, its advantage 0
        acc.a.append(a)
        weights, outside = _weights(c, cfg)
        acc.kl += kl if c.kept else 0.0
        acc.filtered += filtered
        acc.w += sum(weights.values())
        acc.out += sum(outside.values())
        if ref_lp is not None:
            acc.ref_kl += sum(float(_ref_kl(float(ref_lp[t]) - float(c.l[t].detach()), cfg.ref_kl_estimator))
                             for t in c.kept)
        if cfg.method != "gepo" and c.kept:
            total, clipped = _token_method_sum(c, a, weights, entropy, ref_lp, cfg)
            per_completion.append((total, len(c.kept)))
            acc.clipped += clipped
    if cfg.method == "gepo":
        total, acc.clipped = _gepo_terms(seqs, acc.a, group_ids, cfg)
        loss = -total / max(live, 1)
    elif cfg.normalization == "sequence":
        loss = -sum((total / count for total, count in per_completion), torch.zeros((), dtype=torch.float64))
        loss = loss / max(live, 1)
    else:
        loss = -sum((total for total, _ in per_completion), torch.zeros((), dtype=torch.float64))
        loss = loss / (max(kept_tokens, 1) if cfg.normalization == "token" else s_count * cfg.norm_max_len)
    return loss, _logprobs(seqs, logits.shape[0]), _stats(seqs, acc, entropy, cfg)


def _logprobs(seqs, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float64)
    for c in seqs:
        for t in c.given:
            out[t] = float(c.l[t].detach())
    return out


def _stats(seqs, acc, entropy, cfg) -> dict:
    tokens = sum(len(c.kept) for c in seqs)
    with_tokens = sum(1 for c in seqs if c.kept)
    given = sum(len(c.given) for c in seqs)
    return {
        "is_weight_mean": acc.w / max(tokens, 1),
        "is_truncated_frac": acc.out / max(tokens, 1),
        "filtered_frac": acc.filtered / max(with_tokens, 1),
        "kl_mean": acc.kl / max(with_tokens, 1),
        "clip_frac": acc.clipped / max(with_tokens if cfg.method == "gepo" else tokens, 1),
        "entropy_mean": sum(float(entropy[t].detach()) for c in seqs for t in c.kept) / max(tokens, 1),
        "logprob_mean": sum(float(c.l[t].detach()) for c in seqs for t in c.kept) / max(tokens, 1),
        "rejected_frac": (given - tokens) / max(given, 1),
        "rejected_seq_frac": sum(c.emptied for c in seqs) / max(sum(1 for c in seqs if c.given), 1),
        "ref_kl_mean": acc.ref_kl / max(tokens, 1),
        "_reject_statistics": [v for c in seqs for v in c.stats],
    }
