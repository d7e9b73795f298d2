"""A float64 oracle written straight from docs/algorithm.md, one sequence at a time, with full log_softmax.

Deliberately naive and independent of kernels/ftis_kernels/epilogue.py: it materialises the logits and loops in Python.
"""

from __future__ import annotations

import math

import torch

CLAMP = 20.0


def _exp_clamped(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(x, -CLAMP, CLAMP))


def _ppo(r, a, cfg):
    """min(min(r, delta) * A, clip(r) * A), then max(., c * A) for A < 0 under the dual clip (SPEC 2b)."""
    capped = r if cfg.delta is None else torch.clamp(r, max=cfg.delta)
    u = torch.minimum(capped * a, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    if cfg.dual_clip is not None and float(a) < 0:
        u = torch.maximum(u, cfg.dual_clip * a)
    return u


def _clipped(r, a, cfg) -> bool:
    """Whether a clip took the term: its gradient with respect to r is zero (a is nonzero)."""
    if float(a) == 0:
        return False
    r = r.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(_ppo(r, a, cfg), r)
    return float(grad) == 0.0


def _weights(ref, g, cfg):
    """IS weights of one sequence's tokens, and whether each raw weight was outside [is_min or 0, C]."""
    log_ratio = [float(a) - float(b) for a, b in zip(ref, g)]
    if cfg.is_level == "sequence":
        log_ratio = [sum(log_ratio)] * len(log_ratio)
    elif cfg.is_level == "geometric":
        log_ratio = [sum(log_ratio) / len(log_ratio)] * len(log_ratio)
    low = cfg.is_min or 0.0
    raws = [math.exp(max(-CLAMP, min(CLAMP, x))) for x in log_ratio]
    outside = [raw > cfg.is_cap or raw < low for raw in raws]
    if cfg.is_mode == "mask":
        return [0.0 if out else raw for raw, out in zip(raws, outside)], outside
    return [min(max(raw, low), cfg.is_cap) for raw in raws], outside


def _kl_term(x: float, estimator: str) -> float:
    """One token's KL term from x = g - ref, x clamped to [-20, 20] (SPEC sections 1 and 2b)."""
    x = max(-CLAMP, min(CLAMP, x))
    return {"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - x - 1, "k1-gen": x, "k3-gen": math.exp(-x) - 1 + x}[estimator]


def _ref_kl(ref: torch.Tensor, l: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL to the reference per token from x = ref - l (l with its gradient), x clamped to [-20, 20]."""
    x = torch.clamp(ref - l, -20.0, 20.0)
    return {"k3": lambda: torch.exp(x) - x - 1, "k2": lambda: 0.5 * x * x, "k1": lambda: -x}[estimator]()


def oracle(logits, targets, gen, adv, cu, cfg, old=None, group_ids=None, gen_seq=None, ref_lp=None):
    """Returns (loss, logprobs [N], stats dict of floats). `logits` is a float64 [N, V] tensor (may require grad).
    gen_seq: [S] or None; a finite entry is sequence i's generation log-probability G_i, its per-token gen entries
    unknown: the sequence's log-ratio (sum of the IS numerator - G_i) is spread evenly over its tokens."""
    n = logits.shape[0]
    logp_all = torch.log_softmax(logits.double() / cfg.temperature, dim=-1)
    p_all = logp_all.detach().exp()
    entropy_all = -(p_all * logp_all.detach()).sum(-1)
    gen, adv = gen.double(), adv.double()
    old = None if old is None else old.double()
    cu = [int(c) for c in cu]
    num_seqs = len(cu) - 1
    base = cfg.method.removeprefix("f-")
    filtered_method = cfg.method.startswith("f-")

    logprobs = torch.zeros(n, dtype=torch.float64)
    seq_terms = []  # per sequence: (list of counted token indices, l tensor, g, o)
    for i in range(num_seqs):
        toks = [t for t in range(cu[i], cu[i + 1]) if int(targets[t]) != cfg.ignore_index]
        l = torch.stack([logp_all[t, int(targets[t])] for t in toks]) if toks else torch.zeros(0, dtype=torch.float64)
        for k, t in enumerate(toks):
            logprobs[t] = l[k].detach()
        g = gen[toks]
        o = old[toks] if old is not None else l.detach()
        if gen_seq is not None and not math.isnan(float(gen_seq[i])) and toks:
            ref = o if cfg.is_source == "old" else l.detach()
            mean_ratio = (float(ref.sum()) - float(gen_seq[i])) / len(toks)  # log(pi/pi_gen) of the sequence / |y|
            g = torch.tensor([float(r) - mean_ratio for r in ref], dtype=torch.float64)
        seq_terms.append((toks, l, g, o))

    # Rejection (SPEC 2b, verl rollout_rs): blind to A; a rejected token is dropped from everything below.
    given_tokens = sum(len(t[0]) for t in seq_terms)
    all_terms = seq_terms  # before rejection (is_tokens all: a sequence-level IS weight over these)
    emptied = [False] * num_seqs
    statistics = []  # the rejection statistic of each token (reject=token) or sequence
    if cfg.reject != "none":
        kept_terms = []
        for i, (toks, l, g, o) in enumerate(seq_terms):
            ref = o if cfg.is_source == "old" else l.detach()
            d = [_kl_term(float(gt) - float(rt), cfg.reject_estimator) for gt, rt in zip(g, ref)]
            if cfg.reject == "token":
                stats_ = d
            else:
                agg = {"sum": sum(d), "mean": sum(d) / max(len(d), 1), "max": max(d) if d else 0.0}[cfg.reject]
                stats_ = [agg] * len(d)
            statistics.extend(stats_ if cfg.reject == "token" else stats_[:1])
            low = -math.inf if cfg.reject_min is None else cfg.reject_min
            keep = [low <= v <= cfg.reject_max for v in stats_]
            idx = [k for k, kp in enumerate(keep) if kp]
            emptied[i] = bool(toks) and not idx
            kept_terms.append(([toks[k] for k in idx], l[idx], g[idx], o[idx]))
        seq_terms = kept_terms
    live_seqs = num_seqs - sum(emptied) if cfg.reject != "none" else num_seqs

    # KL_i and the filter
    kls, filtered, eff_adv = [], [], []
    for i, (toks, l, g, o) in enumerate(seq_terms):
        kl = sum(_kl_term(float(gt) - float(lt), cfg.kl_estimator) for gt, lt in zip(g, l.detach()))
        if cfg.kl_reduction == "mean":
            kl = kl / max(len(toks), 1)
        elif cfg.kl_reduction == "padded_mean":
            kl = kl / cfg.kl_max_len
        f = filtered_method and bool(toks) and float(adv[i]) <= 0 and kl >= cfg.kl_threshold
        kls.append(kl)
        filtered.append(f)
        eff_adv.append(0.0 if f else float(adv[i]))

    total_tokens = sum(len(t[0]) for t in seq_terms)
    with_tokens = sum(1 for t in seq_terms if t[0])  # the sequences the per-sequence stats are over
    weights, truncated, clip_count, clip_total = [], 0, 0, 0
    seq_weights = []
    for i, (toks, l, g, o) in enumerate(seq_terms):
        ref = o if cfg.is_source == "old" else l.detach()
        w, outside = _weights(ref, g, cfg) if toks else ([], [])
        if toks and cfg.is_tokens == "all" and cfg.is_level != "token":  # the weight of the whole response
            all_toks, all_l, all_g, all_o = all_terms[i]
            all_ref = all_o if cfg.is_source == "old" else all_l.detach()
            w_all, outside_all = _weights(all_ref, all_g, cfg)
            w, outside = [w_all[0]] * len(toks), [outside_all[0]] * len(toks)
        seq_weights.append(torch.tensor(w, dtype=torch.float64))
        weights += w
        truncated += sum(outside)

    if base == "gepo":
        mean_l = [t[1].mean() if len(t[0]) else torch.zeros((), dtype=torch.float64) for t in seq_terms]
        mean_g = [float(t[2].mean()) if len(t[0]) else None for t in seq_terms]
        gids = [0] * num_seqs if group_ids is None else [int(x) for x in group_ids]
        e = {}
        for k in set(gids):
            qs = [math.exp(mean_g[j]) for j in range(num_seqs) if gids[j] == k and mean_g[j] is not None]
            e[k] = sum(q * q for q in qs) / sum(qs) if qs else 1.0
        us = []
        for i in range(num_seqs):
            if not seq_terms[i][0]:
                us.append(torch.zeros((), dtype=torch.float64))
                continue
            r = _exp_clamped(mean_l[i] - math.log(e[gids[i]]))
            a = torch.tensor(eff_adv[i], dtype=torch.float64)
            us.append(_ppo(r, a, cfg))
            clip_count += _clipped(r, a, cfg)
        clip_total = with_tokens
        loss = -torch.stack(us).sum() / max(live_seqs, 1)
    else:
        per_seq = []
        for i, (toks, l, g, o) in enumerate(seq_terms):
            a = torch.tensor(eff_adv[i], dtype=torch.float64)
            ref = g if base == "vis" else o
            if cfg.ratio_level == "sequence" and toks:  # GSPO
                r = _exp_clamped((l - ref).mean()).expand(len(toks))
            else:
                r = _exp_clamped(l - ref)
            if cfg.policy_loss == "cispo":
                weight = torch.clamp(r.detach(), 1 - cfg.eps_low, 1 + cfg.eps_high)
                u = weight * a * l
            else:
                u = torch.stack([_ppo(r[k], a, cfg) for k in range(len(toks))]) if toks else r
            if base == "tis":
                u = seq_weights[i] * u
            if ref_lp is not None and cfg.beta > 0 and toks:
                u = u - cfg.beta * _ref_kl(ref_lp.double()[toks], l, cfg.ref_kl_estimator)
            if cfg.entropy_coef != 0 and toks:  # + coef * H_t, H_t = -sum_v p log p, differentiable
                u = u + cfg.entropy_coef * -(logp_all[toks].exp() * logp_all[toks]).sum(-1)
            per_seq.append(u)
            if cfg.policy_loss == "cispo":
                clip_count += sum(not (1 - cfg.eps_low <= float(r[k].detach()) <= 1 + cfg.eps_high) for k in range(len(toks)))
            else:
                clip_count += sum(_clipped(r[k], a, cfg) for k in range(len(toks)))
        clip_total = total_tokens
        if cfg.normalization == "sequence":
            loss = -sum(u.sum() / max(len(u), 1) for u in per_seq) / max(live_seqs, 1)
        elif cfg.normalization == "token":
            loss = -sum(u.sum() for u in per_seq) / max(total_tokens, 1)
        else:
            loss = -sum(u.sum() for u in per_seq) / (num_seqs * cfg.norm_max_len)

    counted = [t for toks, *_ in seq_terms for t in toks]
    stats = {
        "is_weight_mean": sum(weights) / max(total_tokens, 1),
        "is_truncated_frac": truncated / max(total_tokens, 1),
        "filtered_frac": sum(filtered) / max(with_tokens, 1),
        "kl_mean": sum(k for k, t in zip(kls, seq_terms) if t[0]) / max(with_tokens, 1),
        "clip_frac": clip_count / max(clip_total, 1),
        "entropy_mean": float(entropy_all[counted].sum()) / max(total_tokens, 1),
        "logprob_mean": float(logprobs[counted].sum()) / max(total_tokens, 1),
        "rejected_frac": (given_tokens - total_tokens) / max(given_tokens, 1),
        "rejected_seq_frac": sum(emptied) / max(sum(1 for t in all_terms if t[0]), 1),
        "ref_kl_mean": 0.0 if ref_lp is None else sum(
            float(_ref_kl(ref_lp.double()[toks], l.detach(), cfg.ref_kl_estimator).sum())
            for toks, l, _, _ in seq_terms if toks) / max(total_tokens, 1),
        "_reject_statistics": statistics,
    }
    if not torch.is_tensor(loss):
        loss = torch.zeros((), dtype=torch.float64)
    return loss, logprobs, stats
