"""The step's pieces (step.py): how groups form and what advantages each rollout gets."""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch

from ftis_engine.report import metrics
from ftis_engine.run import step as step_module
from ftis_engine.data.rollouts import Rollout
from ftis_engine.run.session import Start, open_run
from ftis_engine.run.step import group_ids, training_items

from .helpers import short_config


def _rollout(who: int, prompt: int, reward: float, version: int = 0) -> Rollout:
    return Rollout(who, prompt, torch.tensor([5], dtype=torch.int32), torch.tensor([-1.0]), reward, "stop", version)


def _advantages(rewards: list[float]) -> list[float]:
    r = torch.tensor(rewards, dtype=torch.float64)
    return ((r - r.mean()) / (r.std() + 1e-8)).tolist()


def test_horizontal_groups_span_members(tmp_path):
    swarm, _ = open_run(short_config("collaboration=horizontal"), Start(tmp_path / "run"))
    # prompt 3: member 0 scored 1, 0 and member 1 scored 1, 1 -> one group of four
    mixed = [_rollout(0, 3, 1.0), _rollout(0, 3, 0.0), _rollout(1, 3, 1.0), _rollout(1, 3, 1.0)]
    adv = [it.advantage for it in training_items(swarm, swarm.members[0], mixed)]
    assert adv == pytest.approx(_advantages([1.0, 0.0, 1.0, 1.0]), abs=1e-6)
    swarm.close()


def test_vertical_groups_are_one_members_completions_of_one_prompt_at_one_version(tmp_path):
    swarm, _ = open_run(short_config(), Start(tmp_path / "run"))  # collaboration: vertical (the default)
    assert swarm.config.collaboration == "vertical"
    # the same prompt from two members, and from one member at two versions (async): three groups
    rollouts = [_rollout(0, 3, 1.0), _rollout(0, 3, 0.0), _rollout(1, 3, 1.0), _rollout(1, 3, 0.0),
                _rollout(0, 3, 1.0, version=1), _rollout(0, 3, 1.0, version=1), _rollout(1, 4, 1.0),
                _rollout(1, 4, 0.0)]
    assert group_ids(rollouts, "vertical") == [0, 0, 2, 2, 1, 1, 3, 3]
    adv = [it.advantage for it in training_items(swarm, swarm.members[0], rollouts)]
    assert adv == pytest.approx([*_advantages([1.0, 0.0])] * 2 + [0.0, 0.0] + _advantages([1.0, 0.0]), abs=1e-6)
    swarm.close()


def test_an_engines_weight_load_at_wake_up_counts_as_sync_not_generation(tmp_path, monkeypatch):
    """A generator that spends 1 s loading weights as it wakes (as a vLLM engine does after an update, counted in its
    push_seconds) and 0.5 s generating: the step's record moves the load from gen_seconds to sync_seconds, and its
    phases still add up to step_seconds. The phases are timed by a clock of our own (the stopwatch's), which moves
    only where the fake load and generation move it: the test asserts the accounting, not this machine's speed."""
    clock = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time))
    swarm, _ = open_run(short_config(), Start(tmp_path / "run"))
    for member in swarm.members:
        real = member.generator.awake

        @contextlib.contextmanager
        def awake(generator=member.generator, real=real):
            clock[0] += 1.0  # the load
            generator.push_seconds = getattr(generator, "push_seconds", 0.0) + 1.0
            with real():
                yield

        member.generator.awake = awake
    real_rollouts = step_module.sample.generate_rollouts

    def generate(*args):
        clock[0] += 0.5
        return real_rollouts(*args)

    monkeypatch.setattr(step_module.sample, "generate_rollouts", generate)
    records = step_module.run_step(swarm, 1)
    swarm.close()
    assert len(records) == 2
    for record in records:
        assert (record["gen_seconds"], record["sync_seconds"], record["train_seconds"]) == (0.5, 1.0, 0.0)
        phases = ("gen_seconds", "train_seconds", "sync_seconds", "exchange_seconds", "exchange_wait_seconds")
        assert record["step_seconds"] == pytest.approx(sum(record[k] for k in phases))


@pytest.mark.parametrize("passes", ["train.epochs=1", "train.epochs=2"])
def test_a_step_with_nothing_to_train_on_takes_no_optimizer_step_and_goes_on(tmp_path, monkeypatch, passes):
    """Every own group unscored (its scoring timed out) and no peer rollouts (alone): the step trains on nothing.
    It takes no optimizer step, leaves the weights as they were and reports NaN stats and 0 optimizer steps,
    instead of failing in the op's stats (one pass) or the merge of no optimizer steps (epochs x mini-batches)."""
    import dataclasses

    swarm, _ = open_run(short_config("collaboration=alone", passes), Start(tmp_path / "run"))
    real = step_module.sample.generate_rollouts
    monkeypatch.setattr(step_module.sample, "generate_rollouts",
                        lambda *args: [dataclasses.replace(r, reward=float("nan")) for r in real(*args)])
    before = [[p.detach().clone() for p in m.trainable_parameters()] for m in swarm.members]
    records = [r for r in step_module.run_step(swarm, 1) if r["kind"] == "train"]
    swarm.close()
    assert len(records) == 2
    for record, weights, m in zip(records, before, swarm.members):
        assert record["optimizer_steps"] == 0 and record["sequences"] == 0
        assert record["unscored_dropped"] == record["own_sequences"] > 0
        assert all(record[k] != record[k] for k in ("loss", "grad_norm", "is_weight_mean"))  # NaN
        assert all(torch.equal(a, b) for a, b in zip(weights, m.trainable_parameters()))


@pytest.mark.parametrize("where", ["logging.completions=4", "train.epochs=2", "defense.likelihood_floor=-50"])
def test_a_model_that_went_nan_before_its_update_stops_the_step_with_the_divergence_advice(tmp_path, monkeypatch,
                                                                                          where):
    """Member 0's weights turn NaN after it generated: the first forward of its step (the logged completions' loss,
    the old log-probs of several optimizer steps, the screen of its peers' rollouts) finds NaN hidden states and stops
    with the one-line DivergenceError the update gives (member, step, what to do), not the op's NonFiniteInputError."""
    from ftis_engine.model.update import DivergenceError

    swarm, _ = open_run(short_config(where), Start(tmp_path / "run"))
    real = step_module.sample.generate_rollouts

    def generate(swarm_, member, *args):
        rollouts = real(swarm_, member, *args)
        if member.index == 0:
            with torch.no_grad():
                member.model.get_input_embeddings().weight.fill_(float("nan"))
        return rollouts

    monkeypatch.setattr(step_module.sample, "generate_rollouts", generate)
    with pytest.raises(DivergenceError, match=r"^step 1: members\.0 \(tiny-s\) diverged: the model's hidden states "
                                              r"became NaN or inf .*no checkpoint was written before it"):
        step_module.run_step(swarm, 1)
    swarm.close()


def test_a_model_that_went_nan_before_it_generated_stops_the_step_with_the_divergence_advice(tmp_path):
    """Member 0's weights are NaN when its step begins: generation's sampler used to end in multinomial's traceback
    ("probability tensor contains either inf, nan or element < 0"); it is the one-line DivergenceError now."""
    from ftis_engine.model.update import DivergenceError

    swarm, _ = open_run(short_config(), Start(tmp_path / "run"))
    with torch.no_grad():
        swarm.members[0].model.get_input_embeddings().weight.fill_(float("nan"))
    with pytest.raises(DivergenceError, match=r"^step 1: members\.0 \(tiny-s\) diverged: .*logits held NaN or \+inf "
                                              r"in generation.*no checkpoint was written before it"):
        step_module.run_step(swarm, 1)
    swarm.close()


def test_each_generate_call_of_a_step_has_seeds_of_its_own(tmp_path, monkeypatch):
    """A `long` adversary generates its step in two calls (the prompts it fills to the limit, and the rest): the
    second call is seeded past the first one's completions, not with the same seed, which gave its first prompts the
    first call's noise (the HF generator's stream, vLLM's per-request seeds, its default generator)."""
    from ftis_engine.run import sampling as sample

    swarm, _ = open_run(short_config("members.0.adversary.kind=long", "members.0.adversary.rate=0.5"), Start(tmp_path / "run"))
    member = swarm.members[0]
    calls = []
    real = member.generator.generate

    def generate(prompts, sampling, on_batch=None):
        calls.append((len(prompts), sampling.n, sampling.min_new_tokens, sampling.seed))
        return real(prompts, sampling, on_batch)

    monkeypatch.setattr(member.generator, "generate", generate)
    dealt = {p: 3 for p in range(8)}
    rollouts = sample.generate_rollouts(swarm, member, dealt, 0, 1000)
    swarm.close()
    assert len(rollouts) == 24 and {c[2] for c in calls} == {0, 3}  # both calls made (max_new_tokens=3)
    (first, n, _, seed), (_, _, _, second) = calls
    assert (seed, second) == (1000, 1000 + first * n)


def test_a_horizontal_group_that_lost_a_share_is_left_out_on_every_member(tmp_path, monkeypatch):
    """horizontal: a prompt's group is the swarm's (each member generates its share). Member 0's share of one prompt
    holds an unscored completion (its scoring timed out): member 0 leaves its share out, member 1 leaves member 0's
    share out at admission, and both leave the rest of that group out too (partial_group_dropped) instead of
    normalising its advantages over the shares that are left."""
    import dataclasses

    swarm, _ = open_run(short_config("collaboration=horizontal"), Start(tmp_path / "run"))
    real = step_module.sample.generate_rollouts
    unscored = []

    def generate(swarm_, member, *args):
        rollouts = real(swarm_, member, *args)
        if member.index == 0:
            unscored.append(rollouts[0].prompt_index)
            rollouts[0] = dataclasses.replace(rollouts[0], reward=float("nan"))
        return rollouts

    monkeypatch.setattr(step_module.sample, "generate_rollouts", generate)
    trained = {}
    real_items = step_module.training_items
    monkeypatch.setattr(step_module, "training_items",
                        lambda swarm_, member, rollouts: trained.setdefault(member.index, rollouts) and
                        real_items(swarm_, member, rollouts))
    records = [r for r in step_module.run_step(swarm, 1) if r["kind"] == "train"]
    swarm.close()
    share, total = 2, 4 * 4  # group 4 over two members; 4 prompts a step
    assert [(r["unscored_dropped"], r["peer_unscored_dropped"], r["partial_group_dropped"]) for r in records] == \
        [(share, 0, share), (0, share, share)]
    for member in (0, 1):
        assert [r.prompt_index for r in trained[member]].count(unscored[0]) == 0
        assert len(trained[member]) == total - 2 * share
        assert records[member]["sequences"] == total - 2 * share


def test_whole_groups_keeps_only_complete_swarm_groups_in_horizontal_mode():
    rollouts = [Rollout(member=m, prompt_index=p, completion_ids=torch.tensor([5], dtype=torch.int32),
                        gen_logprobs=torch.tensor([-1.0]), reward=1.0, finish_reason="length",
                        policy_version=0)
                for p, members in ((0, (0, 0, 1, 1)), (1, (0, 1, 1)), (2, (0, 0))) for m in members]
    kept, dropped = step_module.whole_groups(rollouts, "horizontal", 4)
    assert [r.prompt_index for r in kept] == [0] * 4 and dropped == 5
    assert step_module.whole_groups(rollouts, "vertical", 4) == (rollouts, 0)
