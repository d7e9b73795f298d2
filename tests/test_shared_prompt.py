"""The shared-prompt update (train.shared_prompt, issue 77): a group's prompt computed once, its completions
attending to it through a mask. The oracle is the packed update (every sequence with its own copy of its prompt),
which the rest of the suite holds against the float64 formulas: the row, the loss, the log-probs and every gradient
must equal it."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model.batch import TrainItem, input_tokens, micro_batches, pack
from ftis_engine.data.rollouts import Rollout
from ftis_engine.model.update import batch_loss, update_member
from ftis_kernels import LossConfig

from .helpers import member


def group_items(vocab: int, n_groups: int = 3, per_group: int = 4, seed: int = 0, member_index: int = 0,
                prompt_len: tuple[int, int] = (2, 9)) -> list[TrainItem]:
    """Groups of `per_group` completions of one prompt each (the rollouts GRPO trains on)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for group in range(n_groups):
        prompt = torch.randint(4, vocab, (int(torch.randint(*prompt_len, (1,), generator=g)),), generator=g).tolist()
        for _ in range(per_group):
            length = int(torch.randint(1, 7, (1,), generator=g))
            rollout = Rollout(member=member_index, prompt_index=group,
                              completion_ids=torch.randint(4, vocab, (length,), generator=g, dtype=torch.int32),
                              gen_logprobs=-torch.rand(length, generator=g) * 6, reward=0.0, finish_reason="length",
                              policy_version=0)
            items.append(TrainItem(rollout, prompt, float(torch.randn(1, generator=g)), group))
    return items


def _loss_and_grads(m, items, shared: bool, cfg: LossConfig, dtype_override=None):
    m.shared_prompt = shared
    m.model.zero_grad(set_to_none=True)
    out = batch_loss(m, pack(items, shared), cfg, "torch")
    out.loss.backward()
    grads = [p.grad.detach().clone() for p in m.trainable_parameters()]
    m.model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logprobs.detach(), grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def test_a_shared_prompt_row_holds_each_prompt_once_and_predicts_the_same_tokens():
    items = group_items(100, n_groups=2, per_group=3, seed=3)
    packed, shared = pack(items), pack(items, shared_prompt=True)
    prompts = sum(len(items[k].prompt_ids) for k in (0, 3))
    assert shared.input_ids.numel() == prompts + sum(it.rollout.num_tokens - 1 for it in items)
    assert shared.input_ids.numel() == input_tokens(items, True) and packed.input_ids.numel() == input_tokens(items)
    for name in ("targets", "gen_logprobs", "advantages", "group_ids", "cu_seqlens"):
        assert torch.equal(getattr(packed, name), getattr(shared, name)), name
    # the row each target is predicted from holds the token before it, at the position it had in the packed row
    for batch in (packed, shared):
        before = torch.cat([torch.tensor([it.prompt_ids[-1], *it.rollout.completion_ids[:-1].tolist()]) for it in items])
        assert torch.equal(batch.input_ids[batch.target_rows], before)
        positions = torch.cat([torch.arange(len(it.prompt_ids) - 1, len(it.prompt_ids) - 1 + it.rollout.num_tokens)
                               for it in items])
        assert torch.equal(batch.position_ids[batch.target_rows], positions)
    # the first completion token of every item of a group is predicted from its prompt's one last row
    first = shared.target_rows[shared.cu_seqlens[:-1].long()]
    assert len(set(first[:3].tolist())) == 1 and len(set(first[3:].tolist())) == 1 and first[0] != first[3]


def test_the_shared_prompt_mask_lets_a_completion_see_its_prompt_and_itself_only():
    items = group_items(100, n_groups=2, per_group=2, seed=1)
    batch = pack(items, shared_prompt=True)
    # the row's layout, walked from the items: prompt rows, then each completion's rows (its tokens but the last)
    expected, start = [], 0
    for group in (items[:2], items[2:]):
        prompt = list(range(start, start + len(group[0].prompt_ids)))
        expected += [set(prompt[: k + 1]) for k in range(len(prompt))]
        start += len(prompt)
        for item in group:
            own = list(range(start, start + item.rollout.num_tokens - 1))
            expected += [set(prompt) | set(own[: k + 1]) for k in range(len(own))]
            start += len(own)
    mask = batch.attention_mask()[0, 0]
    assert mask.shape == (start, start)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in mask] == expected
    additive = batch.attention_mask("additive")[0, 0]
    assert torch.equal(additive == 0, mask) and float(additive.min()) == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="without shared prompts"):
        pack(items).attention_mask()


@pytest.mark.parametrize("overrides, index", [
    ((), 0),                                        # a full fine-tune, sdpa (the CPU's attention)
    (("train.attn_implementation=eager",), 0),      # eager: the additive mask
    ((), 1),                                        # the LoRA member
    (("algorithm.method=gepo",), 0),                # GEPO's group term over whole groups
    (("algorithm.beta=0.1",), 0),                   # the KL penalty's reference forward
], ids=["full-sdpa", "full-eager", "lora", "gepo", "beta"])
def test_the_shared_prompt_loss_logprobs_and_every_gradient_equal_the_packed_updates(overrides, index):
    m, config = member(index, *overrides)
    cfg = config.algorithm.loss_config(config.rollout.temperature)
    items = group_items(len(m.tokenizer), member_index=index)
    loss0, logprobs0, grads0 = _loss_and_grads(m, items, False, cfg)
    loss1, logprobs1, grads1 = _loss_and_grads(m, items, True, cfg)
    assert float(loss0) != 0.0 and any(float(g.abs().max()) > 0 for g in grads0)
    assert abs(float(loss1) - float(loss0)) <= 1e-5 * max(1.0, abs(float(loss0)))
    assert float((logprobs1 - logprobs0).abs().max()) < 1e-4
    assert max(_relative(b, a) for a, b in zip(grads0, grads1)) < 1e-4


def test_in_bf16_compute_the_shared_prompt_update_is_as_close_to_float32_as_the_packed_one():
    """bf16 rounds differently along the two rows: neither equals the other bit for bit, and each is as far from
    the float32 update as the other (the CPU's bf16 units, as the GPU computes)."""
    m, config = member(0)
    cfg = LossConfig()
    items = group_items(len(m.tokenizer), seed=5)
    reference = _loss_and_grads(m, items, False, cfg)
    m.dtype = torch.bfloat16
    packed, shared = _loss_and_grads(m, items, False, cfg), _loss_and_grads(m, items, True, cfg)
    for k in (0, 1):
        packed_error = _relative(packed[k], reference[k])
        assert _relative(shared[k], reference[k]) <= 3 * packed_error + 1e-3
    packed_error = max(_relative(b, a) for a, b in zip(reference[2], packed[2]))
    assert max(_relative(b, a) for a, b in zip(reference[2], shared[2])) <= 3 * packed_error + 1e-3


def test_a_full_update_with_shared_prompt_steps_the_weights_as_the_packed_update():
    results = []
    for shared in (False, True):
        m, _ = member(0)
        m.shared_prompt = shared
        # plain SGD: the step is the gradient itself (Adam's first step is about its sign, which float noise flips
        # on weights whose gradient is ~0)
        m.optimizer = torch.optim.SGD(m.trainable_parameters(), lr=0.1)
        start = [p.detach().clone() for p in m.trainable_parameters()]
        items = group_items(len(m.tokenizer), seed=2)
        stats = update_member(m, items, LossConfig(), token_budget=40, backend="torch", epochs=2)
        results.append((stats, [p.detach() - s for p, s in zip(m.trainable_parameters(), start)]))
    (stats0, moved0), (stats1, moved1) = results
    assert stats1["micro_batches"] < stats0["micro_batches"]  # the same budget holds more sequences
    assert stats0["optimizer_steps"] == stats1["optimizer_steps"] == 2
    assert abs(stats1["loss"] - stats0["loss"]) < 1e-5
    largest = max(float(d.abs().max()) for d in moved0)
    assert largest > 0 and max(float((a - b).abs().max()) for a, b in zip(moved0, moved1)) < 1e-4 * largest


def test_shared_prompt_micro_batches_count_a_prompt_once_keep_every_item_and_fit_the_budget():
    items = group_items(100, n_groups=4, per_group=5, seed=4, prompt_len=(20, 30))
    for budget in (10, 40, 80, 10_000):
        batches = micro_batches(items, budget, shared_prompt=True)
        assert sorted(id(it) for b in batches for it in b) == sorted(id(it) for it in items)
        for b in batches:
            assert len(b) == 1 or input_tokens(b, True) <= budget
    assert len(micro_batches(items, 10_000, shared_prompt=True)) == 1
    # a group over the budget is cut into parts, each with one copy of its prompt
    over = input_tokens(items[:5], True) - 1
    parts = micro_batches(items[:5], over, shared_prompt=True)
    assert len(parts) == 2 and all(input_tokens(part, True) <= over for part in parts)


def test_shared_prompt_is_on_by_default_on_the_cpu_and_off_when_asked():
    assert member(0)[0].shared_prompt
    assert not member(0, "train.shared_prompt=false")[0].shared_prompt


def test_a_model_whose_attention_ignores_the_shared_prompt_mask_is_refused_at_start_naming_the_setting(monkeypatch):
    from ftis_engine.model import update
    from ftis_engine.config import ConfigError
    from ftis_engine.run.preflight import check_model

    m, _ = member(0)
    check_model(m)  # the real attention takes the mask: nothing to say
    real = update.body_inputs

    def without_mask(member_, batch):
        inputs = real(member_, batch)
        inputs.pop("attention_mask", None)
        return inputs

    monkeypatch.setattr(update, "body_inputs", without_mask)
    with pytest.raises(ConfigError, match=r"members\.0\.model: the shared-prompt row does not give the packed row's "
                                          r"hidden states .* set train\.shared_prompt=false"):
        check_model(m)
    m.shared_prompt = False
    check_model(m)
