"""Members that lie on the wire (ftis_engine/adversary.py): what a forger sends, that it trains honestly itself,
and what its forged generation log-probs do to an honest receiver's importance weights and KL filter."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ftis_engine.adversary import FORGED_HIGH, lie
from ftis_engine.config import ConfigError
from ftis_engine.rollouts import Rollout, decode, encode
from ftis_engine.run import train
from ftis_engine.session import open_run

from .helpers import short_config


def _rollouts(n: int) -> list[Rollout]:
    g = torch.Generator().manual_seed(0)
    return [Rollout(1, i % 4, torch.randint(0, 50, (3,), generator=g, dtype=torch.int32), -torch.rand(3, generator=g),
                    1.0, "stop", 0, time.time()) for i in range(n)]


@pytest.mark.parametrize("kind, value", [("forge-high", FORGED_HIGH), ("forge-low", 0.0)])
def test_a_forger_changes_only_the_claimed_log_probs_of_its_rate_share_and_the_wire_carries_them(kind, value):
    honest = _rollouts(400)
    sent, forged = lie(kind, 1.0, honest, seed=0, member=1, step=3)
    assert forged == 400 and all(bool((r.gen_logprobs == value).all()) for r in decode(encode(sent)))
    sent, forged = lie(kind, 0.25, honest, seed=0, member=1, step=3)
    changed = [not torch.equal(a.gen_logprobs, b.gen_logprobs) for a, b in zip(honest, sent)]
    assert sum(changed) == forged and 60 <= forged <= 140  # a quarter of 400, drawn per completion
    assert lie(kind, 0.25, honest, seed=0, member=1, step=3)[1] == forged  # reproducible
    for a, b in zip(honest, sent):
        assert torch.equal(a.completion_ids, b.completion_ids) and (a.reward, a.prompt_index) == (b.reward,
                                                                                                  b.prompt_index)
    assert all(bool((r.gen_logprobs < 0).all()) for r in honest)  # the honest copy is untouched


def test_an_unknown_adversary_kind_or_rate_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^members.1.adversary.kind"):
        short_config("members.1.adversary.kind=inject")
    with pytest.raises(ConfigError, match=r"^members.1.adversary.rate"):
        short_config("members.1.adversary.kind=forge-high", "members.1.adversary.rate=0")


def _run(tmp_path, name, *overrides):
    config = short_config("eval.at_start=false", "eval.every=0", "checkpoint.every=0", "train.steps=2", *overrides)
    swarm, start = open_run(config, tmp_path / name)
    train(swarm, start)
    records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {(r["member"], r["step"]): r for r in records if r["kind"] == "train"}


def test_forged_log_probs_move_an_honest_receivers_weights_and_the_forger_trains_as_if_honest(tmp_path):
    """tiny-s (honest) and tiny-m-lora, honest or forging every completion it sends, the receiver's claims check
    off. At step 1 the forger trains on the same batch either way (its own rollouts, tiny-s's honest ones): the
    same loss. tiny-s receives the forgeries: forge-high (claimed probability e^-20) puts every peer token's weight
    at the cap C, so more of its tokens are truncated and its mean weight rises; forge-low (claimed probability 1)
    shrinks the weights."""
    off = "defense.check_claims=false"
    honest = _run(tmp_path, "honest", off)
    high = _run(tmp_path, "high", off, "members.1.adversary.kind=forge-high")
    low = _run(tmp_path, "low", off, "members.1.adversary.kind=forge-low")
    for forged in (high, low):
        assert forged[("tiny-m-lora", 1)]["loss"] == honest[("tiny-m-lora", 1)]["loss"]
        assert forged[("tiny-m-lora", 1)]["forged_sent"] == forged[("tiny-m-lora", 1)]["own_sequences"] > 0
        assert forged[("tiny-s", 1)]["forged_sent"] == 0
        assert forged[("tiny-m-lora", 1)]["rollouts_sha256"] != honest[("tiny-m-lora", 1)]["rollouts_sha256"]
    receiver = {name: runs[("tiny-s", 1)] for name, runs in (("honest", honest), ("high", high), ("low", low))}
    assert receiver["high"]["is_truncated_frac"] > receiver["honest"]["is_truncated_frac"]
    assert receiver["high"]["is_weight_mean"] > receiver["honest"]["is_weight_mean"] > receiver["low"][
        "is_weight_mean"]
    assert all(r["rejected_batches"] == 0 for runs in (honest, high, low) for r in runs.values())


@pytest.mark.parametrize("kind, said", [("forge-high", "a surprisal no sampler"), ("forge-low", "sum to")])
def test_the_claims_check_refuses_every_forged_parcel_and_no_honest_one(tmp_path, caplog, kind, said):
    """With defense.check_claims at its default, tiny-s refuses each of the forger's parcels (one warning naming
    it and what no sampler can claim) and trains on none of its rollouts; the forger, receiving honest parcels,
    refuses none."""
    runs = _run(tmp_path, kind, f"members.1.adversary.kind={kind}")
    for step in (1, 2):
        assert runs[("tiny-s", step)]["rejected_batches"] == 1 and runs[("tiny-s", step)]["peer_sequences"] == 0
        assert runs[("tiny-m-lora", step)]["rejected_batches"] == 0
        assert runs[("tiny-m-lora", step)]["peer_sequences"] > 0
    warnings = [r.getMessage() for r in caplog.records if "dropped the rollouts of peer tiny-m-lora" in r.getMessage()]
    assert len(warnings) == 2 and all(said in w for w in warnings), warnings


def test_a_long_adversary_fills_its_completions_to_the_limit_with_honest_claims(tmp_path):
    """kind long: every completion of tiny-m-lora runs to rollout.max_new_tokens (its end of sequence suppressed,
    as part of its sampler: the claims check passes them), where an honest tiny-m-lora stops earlier on average."""
    honest = _run(tmp_path, "honest", "rollout.max_new_tokens=12")
    long = _run(tmp_path, "long", "rollout.max_new_tokens=12", "members.1.adversary.kind=long")
    for step in (1, 2):
        assert long[("tiny-m-lora", step)]["completion_len_mean"] == 12
        assert honest[("tiny-m-lora", step)]["completion_len_mean"] < 12
        assert long[("tiny-s", step)]["rejected_batches"] == 0 and long[("tiny-s", step)]["peer_sequences"] > 0
        assert long[("tiny-m-lora", step)]["forged_sent"] == 0
