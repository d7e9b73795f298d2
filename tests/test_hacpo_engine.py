"""algorithm.method: hacpo in the engine: the peer's token count from the wire to the op, its authors' view of a batch
(a final EOS dropped on both sides), the update on real tokenizers equal to its authors' code in float64, the config
and a short run of the tiny default."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model.batch import TrainItem, pack, without_final_eos
from ftis_engine.config import ConfigError, load_config
from ftis_engine.model.models import load_model, load_tokenizer
from ftis_engine.data.rollouts import Rollout, decode, encode, reencoded
from ftis_engine.model.update import batch_loss, packed_hidden
from ftis_kernels import LossConfig

from .helpers import SHORT, TINY, command_here, member, run_records
from .test_hacpo import authors_loss

CHAR, BPE = load_tokenizer("builtin:tiny-s"), load_tokenizer("builtin:tiny-s-bpe")
EOS = 0  # both built-in tokenizers' eos_token_id
assert CHAR.eos_token_id == BPE.eos_token_id == EOS
QUANTUM = 2.0**-12  # log-probs on this grid sum exactly in float32 and float64 alike


def _stop(ids: list[int], stop: bool) -> list[int]:
    return ids + [EOS] if stop else ids


def test_a_foreign_rollout_takes_its_senders_token_count_and_final_eos_from_the_wire():
    """The sender's length word of the header (4 bytes a sequence) is the count hacpo divides by; nothing is added
    to the wire. reencoded is what a receiver builds from a decoded foreign rollout and its own tokens."""
    sent = [Rollout(1, 4, torch.tensor(_stop([23, 24, 25], stop), dtype=torch.int32),
                    -torch.tensor([0.5, 1.25, 2.0, 0.75][:3 + stop]), 1.0, "stop" if stop else "length", 3)
            for stop in (True, False)]
    buffer = encode(sent)
    assert buffer.numel() * 4 == 4 + 32 * 2 + 8 * 7
    for before, got in zip(sent, decode(buffer)):
        mine = reencoded(got, [5, 6, 7, 8, 9, EOS])
        assert mine.seq_tokens == before.num_tokens and mine.seq_logprob == float(before.gen_logprobs.sum())
        assert mine.seq_eos_logprob == (-0.75 if before.finish_reason == "stop" else None)
        assert mine.completion_ids.tolist() == [5, 6, 7, 8, 9, EOS] and float(mine.gen_logprobs.abs().sum()) == 0
        assert (mine.member, mine.prompt_index, mine.reward, mine.finish_reason, mine.policy_version) == (
            got.member, got.prompt_index, got.reward, got.finish_reason, got.policy_version)


def test_the_packed_batch_carries_counts_eos_members_and_the_authors_view_drops_each_final_eos():
    own = Rollout(0, 1, torch.tensor([5, 6, EOS], dtype=torch.int32), -torch.ones(3), 1.0, "stop", 0)
    only_eos = Rollout(0, 1, torch.tensor([EOS], dtype=torch.int32), -torch.ones(1), 0.0, "stop", 0)
    cut = Rollout(2, 1, torch.tensor([7, 8], dtype=torch.int32), -torch.ones(2), 0.0, "length", 0)
    sender = Rollout(1, 1, torch.tensor([30, 31, EOS], dtype=torch.int32), -torch.tensor([1.0, 2.0, 0.5]), 1.0,
                     "stop", 0)
    foreign = reencoded(sender, [9, 9, 9, 9, EOS])
    batch = pack([TrainItem(r, [3, 4], 0.5, 0) for r in (own, only_eos, cut, foreign)])
    assert batch.members.tolist() == [0, 0, 2, 1] and batch.stopped.tolist() == [True, True, False, True]
    assert batch.gen_seq_tokens.tolist() == [0, 0, 0, 3]
    assert torch.isnan(batch.gen_seq_eos_logprobs[:3]).all() and float(batch.gen_seq_eos_logprobs[3]) == -0.5
    view = without_final_eos(batch, -100)
    assert view.targets.tolist() == [5, 6, -100, EOS, 7, 8, 9, 9, 9, 9, -100]  # an EOS-only response keeps it
    assert float(view.gen_seq_logprobs[3]) == -3.0 and int(view.gen_seq_tokens[3]) == 2
    assert torch.equal(view.input_ids, batch.input_ids) and torch.equal(batch.targets[-1:], torch.tensor([EOS]))
    plain = without_final_eos(pack([TrainItem(own, [3, 4], 0.5, 0)]), -100)
    assert plain.gen_seq_logprobs is None and plain.targets.tolist() == [5, 6, -100]


def _logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """A model's log-probs of `ids` after `prompt`, on the QUANTUM grid."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    return (torch.round(lp / QUANTUM) * QUANTUM).clamp(max=-QUANTUM).float()


def test_the_update_on_real_tokenizers_equals_the_authors_code_in_float64():
    """A member of builtin:tiny-s-bpe (member 0) trains on its own rollouts, a same-tokenizer peer's and a foreign
    peer's of builtin:tiny-s (another tokenizer: each text re-encoded here); batch_loss on the authors' view of the
    packed batch against the authors' loss on their own preparation of the same rollouts (the terminal EOS popped
    from the sender's tokens and log-probs, the source mean the sender's sum over its own count, the learner's
    tokens of the text; hacpo_trajectory.py), in float64: loss and every parameter's gradient to 1e-12."""
    m, cfg = member(0, "members.0.model=builtin:tiny-s-bpe", "train.shared_prompt=false")
    m.causal_lm.double()
    sender_model = load_model("builtin:tiny-s", len(CHAR), torch.float32, 3, "sdpa")
    loss_config = LossConfig(method="hacpo", cross_clip_delta=1.0, alpha=0.5)
    texts = [("13=3", True), ("28764=4", True), ("5", True), ("", True), ("901=1,2", False), ("77=7", True),
             ("4444=4", True), ("6=", False), ("12=2", True)]
    kinds = ["own", "own", "own", "peer", "peer", "peer", "foreign", "foreign", "foreign"]
    g = torch.Generator().manual_seed(0)
    items, authors = [], []  # authors: per sequence (the learner's token count kept, the source's mean log-prob)
    for i, ((text, stop), kind) in enumerate(zip(texts, kinds)):
        prompt_bpe = BPE(f"{i}{i}=", add_special_tokens=False)["input_ids"]
        mine = BPE(text, add_special_tokens=False)["input_ids"] if text else []
        advantage = float(torch.randn((), generator=g))
        if kind == "foreign":
            theirs = _stop(CHAR(text, add_special_tokens=False)["input_ids"], stop)
            lp = _logprobs(sender_model, CHAR(f"{i}{i}=", add_special_tokens=False)["input_ids"], theirs)
            sent = Rollout(2, i, torch.tensor(theirs, dtype=torch.int32), lp, 1.0, "stop" if stop else "length", 0)
            rollout = reencoded(decode(encode([sent]))[0], _stop(mine, stop))
            popped = len(theirs) > 1 and stop  # materialize_rollout_records pops a terminal EOS
            source = float(lp[:-1].sum() if popped else lp.sum()) / (len(theirs) - popped)
        else:
            ids = _stop(mine, stop)
            lp = -(torch.rand(len(ids), generator=g) + 0.5)
            rollout = Rollout(0 if kind == "own" else 1, i, torch.tensor(ids, dtype=torch.int32), lp, 1.0,
                              "stop" if stop else "length", 0)
            source = None
        items.append(TrainItem(rollout, prompt_bpe, advantage, i))
        kept = max(len(mine), 1)  # the learner's tokens of the text (an EOS-only response keeps its EOS)
        authors.append((kept, source, kind))
    batch = pack(items)
    with torch.no_grad():  # the old policy of the learner's own rollouts: its log-probs, moved off by up to 3e-4
        hidden = packed_hidden(m, batch)
        _, head = m.body_and_head()
        current = torch.log_softmax(hidden @ head.weight.T, -1).gather(1, batch.targets[:, None]).squeeze(1)
    shift = torch.tensor([0.0, 2e-4, -3e-4, 0.05])
    cu = batch.cu_seqlens.tolist()
    old = torch.cat([(current[cu[k]:cu[k + 1]] + shift[k % 4]).clamp(max=0) for k in range(len(items))]).float()
    batch.old_logprobs = old
    view = without_final_eos(batch, loss_config.ignore_index)

    m.model.zero_grad(set_to_none=True)
    ours = batch_loss(m, view, loss_config, "torch", mini_batch_index=1)
    ours.loss.backward()
    our_grads = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.grad is not None}

    m.model.zero_grad(set_to_none=True)
    hidden = packed_hidden(m, batch)
    log_probs = torch.log_softmax(hidden @ head.weight.T, -1).gather(1, batch.targets[:, None]).squeeze(1)
    width = max(kept for kept, _, _ in authors)
    rows, masks, sources = [], [], []
    for k, (kept, source, kind) in enumerate(authors):
        lp = log_probs[cu[k]:cu[k] + kept]
        rows.append(torch.cat([lp, lp.new_zeros(width - kept)]))
        masks.append(torch.arange(width) < kept)
        if kind == "own":  # the source actor's log-probs of its own tokens
            source = old.double()[cu[k]:cu[k] + kept].mean()
        elif kind == "peer":
            source = items[k].rollout.gen_logprobs.double()[:kept].mean()
        sources.append(torch.as_tensor(source, dtype=torch.float64))
    is_self = torch.tensor([kind == "own" for kind in kinds])
    theirs = authors_loss(torch.stack(rows), torch.stack(masks), torch.stack(sources),
                          torch.tensor([it.advantage for it in items], dtype=torch.float32).double(), is_self,
                          torch.ones(len(items), dtype=torch.float64), 1, loss_config)
    theirs.backward()

    assert abs(float(ours.loss.detach()) - float(theirs.detach())) <= 1e-12
    worst = max(float((p.grad - our_grads[n]).abs().max()) for n, p in m.model.named_parameters()
                if p.grad is not None)
    assert worst <= 1e-12 and set(our_grads) == {n for n, p in m.model.named_parameters() if p.grad is not None}
    assert max(float(v.abs().max()) for v in our_grads.values()) > 1e-4  # the update moves the weights
    assert [kept for kept, _, _ in authors] != [cu[k + 1] - cu[k] for k in range(len(items))]  # EOS dropped
    foreign = [k for k, kind in enumerate(kinds) if kind == "foreign"]
    assert any(int(view.gen_seq_tokens[k]) != authors[k][0] for k in foreign)  # the two sides' lengths differ


@pytest.mark.parametrize("override, field", [
    ("algorithm.alpha=-1", "algorithm.alpha"), ("algorithm.cross_clip_delta=2", "algorithm.cross_clip_delta"),
    ("algorithm.max_abs_log_ratio=50", "algorithm.max_abs_log_ratio"),
])
def test_a_bad_hacpo_option_is_a_one_line_config_error_naming_it(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["algorithm.method=hacpo", override])
    assert str(info.value).startswith(f"{field}: ") and "\n" not in str(info.value)


def test_a_config_with_method_hacpo_and_its_options_builds_the_ops_config():
    config = load_config(TINY, ["algorithm.method=hacpo", "algorithm.alpha=0.5", "algorithm.cross_clip_step=0.05"])
    assert config.algorithm.loss_config(1.0) == LossConfig(method="hacpo", alpha=0.5, cross_clip_step=0.05)
    with pytest.raises(ConfigError, match=r"^algorithm\.normalization: hacpo's loss"):
        load_config(TINY, ["algorithm.method=hacpo", "algorithm.normalization=token"])


def _hacpo_run(capsys, tmp_path, *overrides: str) -> list[dict]:
    """configs/tiny.yaml trained with method hacpo on the short settings, 2 steps, in this process: its train
    records."""
    args = ["train", "--config", TINY, "--output-dir", tmp_path]
    for override in [*SHORT, "algorithm.method=hacpo", "train.steps=2", "eval.every=0", "checkpoint.every=0",
                     *overrides]:
        args += ["--set", override]
    done = command_here(capsys, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_records(tmp_path / "tiny", "train")


def test_the_tiny_default_trains_with_hacpo_end_to_end(capsys, tmp_path):
    """configs/tiny.yaml with --set algorithm.method=hacpo on the short settings, two optimizer steps a step (the
    cross term's bound rises between them), in this process."""
    train = _hacpo_run(capsys, tmp_path, "train.mini_batches=2")
    assert sorted((r["member"], r["step"]) for r in train) == [("tiny-m-lora", 1), ("tiny-m-lora", 2),
                                                               ("tiny-s", 1), ("tiny-s", 2)]
    for r in train:
        assert r["optimizer_steps"] == 2 and r["loss"] == r["loss"] and abs(r["loss"]) < 10, r
        assert 0 <= r["clip_frac"] <= 1 and r["sequences"] > r["own_sequences"] > 0, r


def test_hacpo_trains_on_a_peer_of_another_tokenizer_end_to_end(capsys, tmp_path):
    """The case HACPO's correction is for: tiny-m-bpe's rollouts reach tiny-s as text, re-encoded, with the sender's
    token count; every step trains on them (foreign sequences counted) with a finite loss, in this process."""
    train = _hacpo_run(capsys, tmp_path, "members.1.model=builtin:tiny-m-bpe")
    assert len(train) == 4
    for r in train:
        assert r["foreign_sequences"] > 0 and r["foreign_refused"] == 0, r
        assert r["loss"] == r["loss"] and r["sequences"] > r["own_sequences"] > 0, r


def test_hacpo_keeps_each_members_capability_history_in_its_checkpoint_and_a_resume_goes_on_with_it(capsys,
                                                                                                     tmp_path):
    """Horizontal (the authors' setting: every prompt's group holds both members' shares): each member's tracker
    holds a positive-reward share for itself and its peer at each step (capability.json in its checkpoint), and a
    resume restores it and adds the next step's shares to the same windows."""
    import json

    _hacpo_run(capsys, tmp_path, "collaboration=horizontal", "checkpoint.every=1")
    run = tmp_path / "tiny"

    def windows(step):
        out = {}
        for name in ("tiny-s", "tiny-m-lora"):
            state = json.loads((run / "checkpoints" / f"step-{step}" / "members" / name / "capability.json")
                               .read_text())
            out[name] = state["history"]
        return out

    before = windows(2)
    for history in before.values():
        assert sorted(history) == ["0", "1"] and all(len(w) == 2 and all(1e-8 <= v <= 1 for v in w)
                                                     for w in history.values()), history
    args = ["train", "--config", TINY, "--output-dir", tmp_path, "--resume"]
    for override in [*SHORT, "algorithm.method=hacpo", "train.steps=3", "eval.every=0", "checkpoint.every=1",
                     "collaboration=horizontal"]:
        args += ["--set", override]
    done = command_here(capsys, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    after = windows(3)
    for name, history in after.items():
        assert all(w[:2] == before[name][k] and len(w) == 3 for k, w in history.items()), (name, history)
