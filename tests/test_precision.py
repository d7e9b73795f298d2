"""Mixed precision (precision.py): float32 master weights and Adam states, bf16 compute under autocast, and the
memory-saving mode (bf16 masters with stochastic rounding). The GPU's precision, tested on the CPU."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model.update import accumulate_gradients, update_member

from .helpers import member, random_items


def _trainable(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in m.model.named_parameters() if p.requires_grad}


def _loss_config(cfg):
    return cfg.algorithm.loss_config(cfg.rollout.temperature)


def test_at_lr_1e_6_every_trainable_tensor_of_a_bf16_compute_member_changes_in_one_step():
    """The paper's lr on a full fine-tune computing in bf16: every trainable tensor changes, nearly every element of
    it. The oracle for why it matters: the same Adam step on bf16 parameters (what the engine did before) leaves
    almost every element where it was."""
    m, cfg = member(0, "members.0.dtype=bfloat16", "members.0.lr=1e-6")
    assert m.dtype == torch.bfloat16
    assert {p.dtype for p in m.model.parameters()} == {torch.float32}
    before = _trainable(m)
    update_member(m, random_items(m.vocab_size, seed=1), _loss_config(cfg), 64, "torch")
    assert all(state["exp_avg"].dtype == torch.float32 for state in m.optimizer.state.values())
    after = _trainable(m)
    changed = {n: float((after[n] != before[n]).float().mean()) for n in before}
    assert min(changed.values()) > 0.9, changed

    weight = torch.nn.Parameter(before["model.layers.0.mlp.up_proj.weight"].bfloat16())
    start = weight.detach().clone()
    optimizer = torch.optim.Adam([weight], lr=1e-6)
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert float((weight.detach() != start).float().mean()) < 0.1  # bf16 parameters lose the update


def test_a_lora_member_computing_in_bf16_keeps_its_base_in_bf16_and_its_adapter_float32():
    m, cfg = member(1, "members.1.dtype=bfloat16")
    dtypes = {n: p.dtype for n, p in m.model.named_parameters()}
    assert {dtypes[n] for n in dtypes if "lora_" in n} == {torch.float32}
    assert {dtypes[n] for n in dtypes if "lora_" not in n} == {torch.bfloat16}
    assert all(p.requires_grad == ("lora_" in n) for n, p in m.model.named_parameters())
    before = _trainable(m)
    update_member(m, random_items(m.vocab_size, seed=1), _loss_config(cfg), 64, "torch")
    after = _trainable(m)
    moved = [float((after[n] != before[n]).float().mean()) for n in before if "lora_B" in n]
    assert min(moved) > 0.99  # (lora_A has no gradient while B is 0: it moves from the second step)


@pytest.mark.parametrize("index", [0, 1], ids=["full", "lora"])
def test_a_bf16_compute_update_equals_the_float32_update_within_bf16_tolerance(index):
    """Same member, same batch, float32 and bf16 compute: the loss and stats agree to bf16 rounding, the gradient to
    a few percent, and three Adam steps (lr 1e-3, about lr x sign each) land within a fraction of their length."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        m, cfg = member(index, f"members.{index}.dtype={dtype}", f"members.{index}.lr=1e-3")
        cfgs = _loss_config(cfg)
        start = _trainable(m)
        stats = accumulate_gradients(m, random_items(m.vocab_size, seed=3), cfgs, 64, "torch")
        grads = torch.cat([p.grad.flatten() for p in m.trainable_parameters()])
        m.optimizer.zero_grad(set_to_none=True)
        for seed in (10, 11, 12):
            update_member(m, random_items(m.vocab_size, seed=seed), cfgs, 64, "torch")
        moved = torch.cat([(v - start[n]).flatten() for n, v in _trainable(m).items()])
        runs[dtype] = stats, grads, moved
    (stats32, grads32, moved32), (stats16, grads16, moved16) = runs["float32"], runs["bfloat16"]
    assert stats16["loss"] == pytest.approx(stats32["loss"], rel=0.05, abs=2e-3)
    for key in ("is_weight_mean", "kl_mean", "entropy_mean"):
        assert stats16[key] == pytest.approx(stats32[key], rel=0.02), key
    assert float((grads16 - grads32).norm() / grads32.norm()) < 0.05
    assert float(moved32.abs().max()) > 2.5e-3  # three steps did move the weights
    assert float((moved16 - moved32).norm() / moved32.norm()) < 0.3


def test_own_rollouts_importance_ratio_is_one_when_generation_and_update_both_compute_in_bf16(tmp_path):
    """The HF generator samples under the same autocast the update runs in: the trainer's probability of its own
    freshly sampled tokens over the sampler's stays ~1 (a precision mismatch would show here first)."""
    from ftis_engine.generation import SamplingSettings

    m, cfg = member(0, "members.0.dtype=bfloat16")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = m.generator.generate(prompts, SamplingSettings(n=4, temperature=1.0, top_p=1.0, top_k=None,
                                                         max_new_tokens=6, seed=0))
    from ftis_engine.model.batch import TrainItem, pack
    from ftis_engine.data.rollouts import Rollout
    from ftis_engine.model.update import batch_loss

    items = [TrainItem(Rollout(member=0, prompt_index=i, completion_ids=c.token_ids.int(),
                               gen_logprobs=c.logprobs.float(), reward=0.0, finish_reason="length",
                               policy_version=0), prompts[i], 0.0, i)
             for i, group in enumerate(out) for c in group if c.token_ids.numel()]
    batch = pack(items)
    with torch.no_grad():
        logprobs = batch_loss(m, batch, _loss_config(cfg), "torch").logprobs
    ratio = (logprobs - batch.gen_logprobs).exp()
    assert float((ratio - 1).abs().max()) < 0.05


def test_the_memory_plan_counts_exactly_the_bytes_a_member_holds_in_each_precision():
    """state_bytes (the memory plan's weights, gradients and Adam states) against the tensors a member holds after
    one step, for float32 and bf16 masters, full and LoRA."""
    from ftis_engine.run.preflight import model_shape, state_bytes

    for index, master in ((0, "float32"), (1, "float32"), (0, "bfloat16")):
        extra = [f"members.{index}.optimizer=adamw"] if master == "bfloat16" else []
        m, cfg = member(index, f"members.{index}.dtype=bfloat16", f"members.{index}.master_dtype={master}", *extra)
        update_member(m, random_items(m.vocab_size, seed=1), _loss_config(cfg), 64, "torch")
        for p in m.trainable_parameters():  # a gradient is held through the step (zero_grad frees it after)
            p.grad = torch.zeros_like(p)
        held = sum(p.numel() * p.element_size() for p in m.model.parameters())
        held += sum(p.grad.numel() * p.grad.element_size() for p in m.trainable_parameters())
        held += sum(v.numel() * v.element_size() for state in m.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        assert state_bytes(cfg, index, model_shape(cfg.members[index].model)) == held, (index, master)


def test_bf16_masters_step_with_stochastic_rounding_and_move_as_float32_masters_do_on_average():
    """The memory-saving mode: bf16 parameters and Adam states, torchao's AdamW with stochastic rounding. At lr 1e-6
    each step is far below bf16's spacing, yet the weights move by about what float32 masters move (in sum, with
    sign), where rounding to nearest would leave them (the oracle test above)."""
    moved = {}
    for master in ("float32", "bfloat16"):
        m, cfg = member(0, "members.0.dtype=bfloat16", f"members.0.master_dtype={master}", "members.0.lr=1e-6",
                        "members.0.optimizer=adamw")
        start = _trainable(m)
        for seed in (10, 11, 12):
            update_member(m, random_items(m.vocab_size, seed=seed), _loss_config(cfg), 64, "torch")
        moved[master] = torch.cat([(v - start[n]).flatten() for n, v in _trainable(m).items()])
        if master == "bfloat16":
            assert {p.dtype for p in m.model.parameters()} == {torch.bfloat16}
            assert type(m.optimizer).__module__.startswith("torchao")
    exact, rounded = moved["float32"], moved["bfloat16"]
    assert 0.7 < float(rounded.abs().sum() / exact.abs().sum()) < 1.5
    assert abs(float((rounded - exact).sum() / exact.abs().sum())) < 0.2


def test_bf16_masters_need_bf16_compute_and_a_decoupled_optimizer():
    from ftis_engine.config import ConfigError
    from ftis_engine.run.preflight import check_members

    with pytest.raises(ConfigError, match=r"^members.0.master_dtype: bfloat16 masters compute in bfloat16; set "
                                          r"members.0.dtype=bfloat16"):
        member(0, "members.0.master_dtype=bfloat16", "members.0.optimizer=adamw")
    from .helpers import short_config

    with pytest.raises(ConfigError, match=r"^members.0.master_dtype: .*set members.0.optimizer=adamw"):
        check_members(short_config("members.0.master_dtype=bfloat16", "members.0.weight_decay=0.1"))


@pytest.mark.slow
def test_a_bf16_compute_run_resumed_from_its_checkpoint_continues_bit_exactly(tmp_path):
    """Both members compute in bf16; a run stopped after its step-2 checkpoint (as a kill after it would leave it)
    and resumed gives the same steps 3-4 (loss, gradient norm, rollouts' digest) and the same weights, bit for bit,
    as the run that went through: the checkpoint holds the float32 masters and the Adam states."""
    from safetensors.torch import load_file

    from .helpers import run_records
    from .test_e2e import run_cli, train_args

    bf16 = ["members.0.dtype=bfloat16", "members.1.dtype=bfloat16", "eval.every=0", "checkpoint.every=2"]
    assert run_cli(*train_args(tmp_path / "through", *bf16, "train.steps=4")) == 0
    assert run_cli(*train_args(tmp_path / "resumed", *bf16, "train.steps=2")) == 0
    assert run_cli(*train_args(tmp_path / "resumed", *bf16, "train.steps=4"), "--resume") == 0
    key = ("loss", "grad_norm", "rollouts_sha256", "is_weight_mean")
    steps = {name: {(r["step"], r["member"]): tuple(r[k] for k in key) for r in run_records(tmp_path / name / "e2e")
                    if r["kind"] == "train"} for name in ("through", "resumed")}
    assert steps["resumed"] == steps["through"] and len(steps["through"]) == 8
    for name, weights in (("tiny-s", "model.safetensors"), ("tiny-m-lora", "adapter_model.safetensors")):
        saved = [load_file(tmp_path / run / "e2e" / "checkpoints" / "step-4" / "members" / name / "model" / weights)
                 for run in ("through", "resumed")]
        assert {t.dtype for t in saved[0].values()} == {torch.float32}
        assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


@pytest.mark.slow
def test_the_tiny_default_in_bf16_at_lr_1e_6_changes_nearly_every_saved_weight_between_steps_1_and_4(tmp_path):
    """`ftis-engine train --config configs/tiny.yaml --set members.0.dtype=bfloat16 --set members.0.lr=1e-6`
    (shortened to 4 steps, a checkpoint every step): at least 90% of tiny-s's saved weights differ between its
    step-1 and step-4 checkpoints (bf16 parameters changed 0.54%)."""
    from safetensors.torch import load_file

    from .test_e2e import run_cli, train_args

    assert run_cli(*train_args(tmp_path, "members.0.dtype=bfloat16", "members.0.lr=1e-6", "train.steps=4",
                               "checkpoint.every=1", "checkpoint.keep_last=4", "eval.every=0")) == 0
    saved = [load_file(tmp_path / "e2e" / "checkpoints" / f"step-{s}" / "members" / "tiny-s" / "model" /
                       "model.safetensors") for s in (1, 4)]
    changed = sum(int((saved[0][k] != saved[1][k]).sum()) for k in saved[0])
    assert changed / sum(t.numel() for t in saved[0].values()) >= 0.9


def test_a_run_with_bf16_masters_trains_and_resumes_end_to_end(tmp_path):
    """The memory-saving mode through `ftis-engine train` (the GPU rehearsal found it broken there: torchao's AdamW
    keeps the learning rate as a tensor and refused the schedule's float): 2 steps, then resumed to 3; the resumed
    run's rate is the config's and the weights move in every step."""
    from safetensors.torch import load_file

    from .test_e2e import run_cli, train_args

    over = ("members.0.dtype=bfloat16", "members.0.master_dtype=bfloat16", "members.0.optimizer=adamw",
            "members.0.lr=1e-5", "checkpoint.every=1", "checkpoint.keep_last=3", "eval.every=0")
    assert run_cli(*train_args(tmp_path, *over, "train.steps=2")) == 0
    assert run_cli(*train_args(tmp_path, *over, "train.steps=3"), "--resume") == 0
    saved = [load_file(tmp_path / "e2e" / "checkpoints" / f"step-{s}" / "members" / "tiny-s" / "model" /
                       "model.safetensors") for s in (1, 2, 3)]
    assert {t.dtype for t in saved[0].values()} == {torch.bfloat16}
    for before, after in zip(saved, saved[1:]):
        assert sum(int((before[k] != after[k]).sum()) for k in before) > 0


def _params(seed: int) -> list[torch.nn.Parameter]:
    """Small parameters with signed zeros among their values (a step of lr 0 must keep -0.0 as -0.0)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(7, 5, generator=g)
    first[0, :2] = torch.tensor([0.0, -0.0])
    return [torch.nn.Parameter(first), torch.nn.Parameter(torch.randn(11, generator=g))]


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("path", ["foreach", "single", "fused"])
def test_adam_states_made_at_build_leave_the_weights_and_every_later_step_exactly_as_lazy_ones(kind, weight_decay,
                                                                                              path):
    """Issue 81's lever: on a GPU the Adam states are created when the optimizer is built (materialise_states), not
    inside the first update. The oracle is the lazy optimizer: after the build the weights are bit for bit as they
    were (signed zeros too), and three steps later weights and states equal the lazy optimizer's bit for bit."""
    from ftis_engine.model.precision import materialise_states

    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    options = {"foreach": {"foreach": True}, "single": {"foreach": False}, "fused": {"fused": True}}[path]
    lazy, eager = _params(0), _params(0)
    made = [cls(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=weight_decay, **options) for ps in (lazy, eager)]
    materialise_states(made[1])
    assert all(torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()) for a, b in zip(lazy, eager))
    assert all(p.grad is None for p in eager) and made[1].param_groups[0]["lr"] == 1e-2
    assert all(float(made[1].state[p]["step"]) == 0 for p in eager) and made[0].state == {}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in lazy]
        for ps, optimizer in zip((lazy, eager), made):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(lazy, eager))
    for a, b in zip(lazy, eager):
        assert made[0].state[a].keys() == made[1].state[b].keys()
        assert all(torch.equal(made[0].state[a][k], made[1].state[b][k]) for k in made[0].state[a])


def test_the_optimizer_is_fused_and_its_states_made_at_build_only_on_one_gpu(monkeypatch):
    """On the CPU (every run and test here) make_optimizer keeps torch's default path, lazy states: nothing changes
    in a CPU run's numbers. On one GPU (stood in for by the CPU's fused Adam) it asks for the fused step and makes the
    states at once."""
    from ftis_engine.model import precision

    cpu = precision.make_optimizer(_params(0), "adam", 1e-3, (0.9, 0.999), 0.0, torch.float32)
    assert not precision.on_one_gpu(_params(0)) and not cpu.defaults.get("fused") and cpu.state == {}
    monkeypatch.setattr(precision, "on_one_gpu", lambda params: True)
    gpu = precision.make_optimizer(_params(0), "adamw", 1e-3, (0.9, 0.999), 0.1, torch.float32)
    assert gpu.defaults["fused"] is True
    assert [sorted(s) for s in gpu.state.values()] == [["exp_avg", "exp_avg_sq", "step"]] * 2
