"""Warm start: a cached supervised phase on the task's demonstrations before RL."""

from __future__ import annotations

import pytest
import torch

from ftis_engine.model import warmstart
from ftis_engine.config import ConfigError, DataSettings, WarmStartSettings
from ftis_engine.model.models import load_model, load_tokenizer
from ftis_engine.data.tasks import load_task, prompt_ids

from .helpers import short_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path))
    return tmp_path / "warm-start"


def _setup(seed=0):
    tokenizer = load_tokenizer("builtin:tiny-s")
    task = load_task(DataSettings(task="arith"), 0)
    model = load_model("builtin:tiny-s", len(tokenizer), torch.float32, seed, "sdpa")
    return tokenizer, task, model


def demonstration_loss(model, tokenizer, task, style="columns") -> float:
    """Mean cross-entropy of held-out demonstrations' completion tokens (the oracle of what SFT lowers)."""
    total, count = 0.0, 0
    for question, completion in task.demonstrations(style, 32, seed=999):
        prompt = prompt_ids(tokenizer, task, question)
        answer = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(answer), reduction="sum").item()
        count += len(answer)
    return total / count


def test_the_supervised_phase_lowers_the_demonstrations_loss(cache):
    tokenizer, task, model = _setup()
    before = demonstration_loss(model, tokenizer, task)
    warmstart.warm_start(model, tokenizer, task, WarmStartSettings(style="columns", steps=30), "builtin:tiny-s", 0,
                         torch.device("cpu"))
    after = demonstration_loss(model, tokenizer, task)
    assert after < 0.6 * before


def test_a_warm_start_is_computed_once_and_then_loaded_bit_identical(cache, monkeypatch):
    settings = WarmStartSettings(style="columns", steps=3)
    tokenizer, task, first = _setup()
    path = warmstart.warm_start(first, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu"))
    assert path.parent == cache and path.is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("the cached weights should have been loaded")

    monkeypatch.setattr(warmstart, "supervised_phase", no_training)
    _, _, second = _setup()
    assert warmstart.warm_start(second, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu")) == path
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_the_cache_key_changes_with_everything_that_changes_the_weights():
    base = dict(model_spec="builtin:tiny-s", init_seed=0, task_name="arith", dtype=torch.float32, vocab_size=101)
    settings = WarmStartSettings(style="columns")
    key = warmstart.cache_key(settings=settings, **base)
    assert key == warmstart.cache_key(settings=WarmStartSettings(style="columns"), **base)
    others = [
        warmstart.cache_key(settings=WarmStartSettings(style="carry-first"), **base),
        warmstart.cache_key(settings=WarmStartSettings(style="columns", steps=201), **base),
        warmstart.cache_key(settings=WarmStartSettings(style="columns", lr=1e-3), **base),
        warmstart.cache_key(settings=settings, **{**base, "init_seed": 1}),
        warmstart.cache_key(settings=settings, **{**base, "model_spec": "builtin:tiny-m"}),
        warmstart.cache_key(settings=settings, **{**base, "dtype": torch.bfloat16}),
    ]
    assert len({key, *others}) == len(others) + 1


def test_a_member_built_with_a_warm_start_starts_from_the_cached_weights(cache):
    from ftis_engine.member.members import build_member

    config = short_config("data.task=arith", "members.0.warm_start.style=columns",
                          "members.0.warm_start.steps=3", "rollout.max_new_tokens=32")
    tokenizer, task, model = _setup(seed=config.seed)
    warmstart.warm_start(model, tokenizer, task, config.members[0].warm_start, "builtin:tiny-s", config.seed,
                         torch.device("cpu"))
    member = build_member(0, config, tokenizer, torch.device("cpu"), task)
    for a, b in zip(model.state_dict().values(), member.causal_lm.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overrides, field", [
    (["members.0.warm_start.style=rows"], "members.0.warm_start.style"),
    (["members.0.warm_start.steps=0"], "members.0.warm_start.steps"),
    (["members.0.warm_start.lr=nan"], "members.0.warm_start.lr"),
])
def test_a_bad_warm_start_names_the_field(overrides, field, cache):
    from ftis_engine.member.members import check_warm_start

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config = short_config("data.task=arith", "members.0.warm_start.style=columns", *overrides)
        check_warm_start(0, config.members[0], load_task(config.data, 0))


def test_a_task_without_demonstrations_refuses_a_warm_start():
    from ftis_engine.member.members import check_warm_start

    config = short_config("members.0.warm_start.style=columns")  # the tiny default's tiny-last has none
    with pytest.raises(ConfigError, match=r"members\.0\.warm_start: task 'tiny-last' has no demonstrations"):
        check_warm_start(0, config.members[0], load_task(config.data, 0))


def test_members_with_the_same_seed_offset_start_as_twins_at_every_run_seed(cache):
    from ftis_engine.member.members import build_member, member_init_seed

    twins = ["data.task=arith", "rollout.max_new_tokens=32", "members.1.model=builtin:tiny-s", "members.1.lora=null",
             "members.1.seed=null",  # the tiny default pins tiny-m-lora's init
             "members.0.warm_start.style=columns", "members.0.warm_start.steps=3",
             "members.1.warm_start.style=columns", "members.1.warm_start.steps=3"]
    tokenizer = load_tokenizer("builtin:tiny-s")
    for seed in (0, 5):
        config = short_config(*twins, "members.1.seed_offset=0", f"seed={seed}")
        task = load_task(config.data, seed)
        assert member_init_seed(config, 0) == member_init_seed(config, 1)
        a, b = (build_member(i, config, tokenizer, torch.device("cpu"), task).causal_lm.state_dict() for i in (0, 1))
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the default offset is the member's index, and a fixed seed wins over any offset
    config = short_config(*twins, "seed=5")
    a, b = (build_member(i, config, tokenizer, torch.device("cpu"), task).causal_lm.state_dict() for i in (0, 1))
    assert member_init_seed(config, 1) != member_init_seed(config, 0) and not all(torch.equal(a[k], b[k]) for k in a)
    assert member_init_seed(short_config(*twins, "members.1.seed_offset=0", "members.1.seed=9"), 1) == 9


@pytest.mark.parametrize("damage", ["truncated", "empty", "code", "not-a-state-dict"])
def test_a_broken_cache_entry_is_said_and_rebuilt_never_fatal(cache, damage, caplog):
    import logging
    import pickle

    settings = WarmStartSettings(style="columns", steps=3)
    tokenizer, task, first = _setup()
    path = warmstart.warm_start(first, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu"))
    good = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "code":  # a pickle that would run code when loaded without weights_only
        path.write_bytes(pickle.dumps(__import__("os").getcwd))
    else:
        torch.save({"weights": [1, 2]}, path)
    _, _, second = _setup()
    with caplog.at_level(logging.WARNING, logger="ftis_engine"):
        assert warmstart.warm_start(second, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu")) == path
    assert "cannot be used" in caplog.text and "computing it again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert torch.load(path, weights_only=True).keys() == first.state_dict().keys()  # replaced by a good one


def test_an_error_of_the_code_reading_a_cache_entry_is_raised_as_itself(cache, monkeypatch):
    """Only what torch.load raises for a damaged file means "cannot be used": an AttributeError is not rebuilt over."""
    settings = WarmStartSettings(style="columns", steps=3)
    tokenizer, task, first = _setup()
    warmstart.warm_start(first, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu"))

    def broken(*args, **kwargs):
        raise AttributeError("module 'torch' has no attribute 'serialization'")

    monkeypatch.setattr(warmstart.torch, "load", broken)
    with pytest.raises(AttributeError, match="has no attribute 'serialization'"):
        warmstart.warm_start(first, tokenizer, task, settings, "builtin:tiny-s", 0, torch.device("cpu"))


def test_a_cache_directory_that_cannot_be_used_is_one_line_naming_ftis_cache_dir(tmp_path, monkeypatch):
    from ftis_engine.config import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FTIS_CACHE_DIR", str(blocker))
    tokenizer, task, model = _setup()
    with pytest.raises(ConfigError, match=r"^FTIS_CACHE_DIR: cannot keep warm starts in .*a-file/warm-start"):
        warmstart.warm_start(model, tokenizer, task, WarmStartSettings(style="columns", steps=3), "builtin:tiny-s", 0,
                             torch.device("cpu"))


def test_no_members_init_at_one_run_seed_is_another_members_at_another_run_seed():
    """A study's seeds are independent replications: with init seed = run seed + index, member 1 at run seed s
    started as member 0 at run seed s + 1 (a random peer of the distance study was exactly that init)."""
    from ftis_engine.member.members import member_init_seed

    config = short_config("members.1.model=builtin:tiny-s", "members.1.seed=null")  # the default pins it
    inits = {}
    for seed in range(20):
        for index in (0, 1):
            inits.setdefault(member_init_seed(config.model_copy(update={"seed": seed}), index), []).append((seed, index))
    assert all(len(who) == 1 for who in inits.values()), [who for who in inits.values() if len(who) > 1]
