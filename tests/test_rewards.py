"""binary_answer_reward (docs/algorithm.md, section 2) on the real GSM8K and MATH-500 answers, and the format rules."""

from __future__ import annotations

import json

import pytest

from ftis_engine.data.rewards import binary_answer_reward, extract_answer, load_reward, tiny_answer_reward
from ftis_engine.data.tasks.math import gsm8k_gold


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _paper_format(answer: str) -> str:
    return f"<think>Let me work through it step by step.</think><answer>{answer}</answer>"


def test_every_gsm8k_gold_answer_scores_one_and_a_wrong_one_zero(shared_data):
    rows = _rows(shared_data / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319
    for row in rows:
        gold = gsm8k_gold(row["answer"])
        assert binary_answer_reward(_paper_format(gold), gold) == 1.0, gold
        wrong = f"{float(gold) + 1:g}"
        assert binary_answer_reward(_paper_format(wrong), gold) == 0.0, gold


def test_every_math500_gold_answer_scores_one(shared_data):
    rows = _rows(shared_data / "math500" / "test.jsonl")
    assert len(rows) == 500
    wrong_checked = 0
    for row in rows:
        gold = row["answer"]
        assert binary_answer_reward(_paper_format(gold), gold) == 1.0, gold
        if gold.lstrip("-").isdigit():
            assert binary_answer_reward(_paper_format(str(int(gold) + 1)), gold) == 0.0, gold
            wrong_checked += 1
    assert wrong_checked > 100


def test_gsm8k_gold_is_the_text_after_the_marks_without_commas():
    assert gsm8k_gold("so 1,234 in all\n#### 1,234") == "1234"
    with pytest.raises(ValueError):
        gsm8k_gold("no marks here")


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>18</answer>",  # no think block
        "<think>x</think>18",  # no answer block
        "<answer>18</answer><think>x</think>",  # wrong order
        "<think>x</think><answer>18</answer> and more",  # text after </answer>
        "<think>x</think><think>y</think><answer>18</answer>",  # a tag twice
        "<think>x</think><answer>18</answer></answer>",
        "prefix <think>x</think><answer>18</answer>",  # text before <think>
        "<think>x</think>between<answer>18</answer>",  # text between the blocks
        "<think>x</think><answer></answer>",  # empty answer
        "",
    ],
)
def test_broken_format_scores_zero(completion):
    assert binary_answer_reward(completion, "18") == 0.0


def test_equivalent_forms_score_one():
    assert binary_answer_reward("<think>a</think>\n<answer>$18.00$</answer>\n", "18") == 1.0
    assert binary_answer_reward("<think>a</think><answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac12") == 1.0
    assert binary_answer_reward("<think>a</think><answer>0.5</answer>", "\\frac{1}{2}") == 1.0
    assert extract_answer(" <think>a</think> <answer> 7 </answer> ") == "7"


def test_tiny_reward_and_dotted_loading():
    assert tiny_answer_reward(" 7x", "7") == 1.0 and tiny_answer_reward("x7", "7") == 0.0
    assert load_reward("ftis_engine.data.rewards:tiny_answer_reward") is tiny_answer_reward
    assert load_reward("ftis_engine.data.rewards.tiny_answer_reward") is tiny_answer_reward
    with pytest.raises(ValueError):
        load_reward("ftis_engine.data.rewards:nothing_here")


def test_a_math_verify_time_out_is_no_verdict_not_a_zero(monkeypatch):
    import math_verify
    from math_verify.errors import TimeoutException

    from ftis_engine.data.rewards import RewardTimeout

    def slow_parse(*args, **kwargs):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(math_verify, "parse", slow_parse)
    with pytest.raises(RewardTimeout, match="timed out") as caught:
        binary_answer_reward("<think>x</think><answer>12</answer>", "12")
    assert isinstance(caught.value.__cause__, TimeoutException)
    assert binary_answer_reward("no tags at all", "12") == 0.0  # nothing to parse: a verdict


BAD_REWARDS = '''
import math
import torch


def raises(completion, gold):
    raise KeyError("no such thing")


def nan(completion, gold):
    return math.nan


def inf(completion, gold):
    return math.inf


def none(completion, gold):
    return None


def text(completion, gold):
    return "1.0"


def tensor(completion, gold):
    return torch.tensor(1.0)


def one_argument(completion):
    return 1.0


def good(completion, gold):
    return float(completion.strip() == gold)


finished = []  # the two below, each when it ran to its end: a bound that interrupts them leaves this empty


def sleeps(completion, gold):
    import time
    for _ in range(600):  # a minute in naps of 0.1 s, far past the bound the test sets
        time.sleep(0.1)
    finished.append("sleeps")
    return 1.0


def spins_and_swallows(completion, gold):
    for _ in range(5_000_000):  # tens of seconds of work (a minute or more on a loaded machine), swallowing anything
        try:
            sum(range(1000))
        except Exception:
            pass
    finished.append("spins_and_swallows")
    return 1.0
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(BAD_REWARDS)
    (tmp_path / "broken_syntax.py").write_text("def r(completion, gold)\n    return 1\n")
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards"


@pytest.mark.parametrize("name, said", [
    ("raises", r"raised KeyError: 'no such thing'"), ("nan", r"returned nan \(float\); a reward is a finite number"),
    ("inf", r"returned inf \(float\)"), ("none", r"returned None \(NoneType\)"), ("text", r"returned '1.0' \(str\)"),
    ("tensor", r"returned tensor\(1.\) \(Tensor\)"),
])
def test_a_user_reward_that_fails_stops_with_one_line_naming_it_and_the_completion(reward_module, name, said):
    from ftis_engine.data.tasks import Example, Task
    from ftis_engine.data.tasks.base import RewardError

    from .test_admission import DigitTokenizer

    task = Task("digits", [Example("q", "7")], {}, load_reward(f"{reward_module}:{name}"))
    with pytest.raises(RewardError, match=rf"^data.reward: user_rewards:{name}\('123', '7'\) {said}") as caught:
        task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")])
    assert "\n" not in str(caught.value)
    good = Task("digits", [Example("q", "7")], {}, load_reward(f"{reward_module}:good"))
    assert good.score(DigitTokenizer(), [[7], [3]], [Example("q", "7")] * 2) == [1.0, 0.0]


@pytest.mark.parametrize("name", ["sleeps", "spins_and_swallows"])
def test_a_reward_that_runs_past_data_reward_timeout_s_is_interrupted_there_and_named(reward_module, name):
    import time

    from ftis_engine.data.tasks import Example, Task
    from ftis_engine.data.tasks.base import RewardError

    from .test_admission import DigitTokenizer

    reward = load_reward(f"{reward_module}:{name}")
    task = Task("digits", [Example("q", "7")], {}, reward)
    task.reward_timeout_s = 0.5
    with pytest.raises(RewardError, match=rf"^data.reward: user_rewards:{name}\('123', '7'\) did not return within "
                                          r"0.5 s \(data.reward_timeout_s\)"):
        task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")])
    assert reward.__globals__["finished"] == []  # interrupted, not waited out: the reward never ran to its end
    # a call that returns in time leaves nothing armed: later code (a sleep past the bound) is not interrupted
    good = Task("digits", [Example("q", "7")], {}, load_reward(f"{reward_module}:good"))
    good.reward_timeout_s = 0.2
    assert good.score(DigitTokenizer(), [[7], [3]], [Example("q", "7")] * 2) == [1.0, 0.0]
    time.sleep(0.5)


def test_the_reward_bound_is_a_config_field_that_reaches_the_task_and_may_change_on_resume():
    from ftis_engine.config import RunConfig
    from ftis_engine.run.rundir import resumable
    from ftis_engine.data.tasks import load_task

    data = RunConfig.model_validate({"members": [{"name": "a", "model": "builtin:tiny-s"}],
                                     "data": {"task": "tiny-add", "reward_timeout_s": 7}}).data
    assert load_task(data, seed=0).reward_timeout_s == 7.0
    assert resumable("data.reward_timeout_s")
    with pytest.raises(ValueError, match="reward_timeout_s"):
        RunConfig.model_validate({"members": [{"name": "a", "model": "builtin:tiny-s"}],
                                  "data": {"reward_timeout_s": 0}})


@pytest.mark.parametrize("path, said", [
    ("user_rewards:one_argument", r"must take two arguments \(completion, gold\); its signature is \(completion\)"),
    ("broken_syntax:r", r"cannot import 'broken_syntax': SyntaxError \(line 1\)"),
    ("raises_at_import:r", r"cannot import 'raises_at_import': RuntimeError: no GPU here"),
    ("user_rewards:missing", r"is not a callable in user_rewards"),
])
def test_a_reward_that_cannot_be_loaded_or_called_with_two_arguments_is_refused_at_load(reward_module, path, said):
    with pytest.raises(ValueError, match=said):
        load_reward(path)


@pytest.mark.slow
def test_a_run_whose_reward_returns_nan_exits_2_with_one_line_before_any_update(reward_module, tmp_path):
    import subprocess
    import sys

    from .helpers import SHORT, TINY

    args = ["train", "--config", str(TINY), "--output-dir", str(tmp_path)]
    for override in [*SHORT, "data.reward=user_rewards:nan", "eval.at_start=false"]:
        args += ["--set", override]
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ftis_engine", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in done.stderr
    assert error[0].startswith("error: data.reward: user_rewards:nan(") and "returned nan" in error[0]
    assert not (tmp_path / "tiny" / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------- escaped dollars


@pytest.mark.parametrize("answer, gold, reward", [
    ("\\$18", "18", 1.0), ("\\$18.00", "18", 1.0), ("18", "\\$18", 1.0), ("\\$19", "18", 0.0),
    ("32348", "\\$32,\\!348", 1.0), ("18.9", "\\$18.90", 1.0), ("$36$", "\\$36", 1.0), ("37", "\\$36", 0.0),
])
def test_an_escaped_dollar_is_a_currency_sign_not_a_math_delimiter(answer, gold, reward):
    assert binary_answer_reward(_paper_format(answer), gold) == reward


def test_every_math500_gold_answer_parses_as_math_not_only_as_text(shared_data):
    from ftis_engine.data.rewards import _parse

    golds = [row["answer"] for row in _rows(shared_data / "math500" / "test.jsonl")]
    assert [gold for gold in golds if not _parse(gold)] == []  # were: \$36, \$18.90, \$32,\!348


# ----------------------------------------------------------------------------------------------- data.rewards terms


TERMS = '''
calls = []


def right(completion, gold):
    calls.append("right")
    return float(completion.strip() == gold)


def short(completion, gold):
    calls.append("short")
    return float(len(completion) <= 2)


def raises(completion, gold):
    raise KeyError("no such thing")


def nan(completion, gold):
    return float("nan")


def sleeps(completion, gold):
    import time
    time.sleep(3600)


def huge(completion, gold):
    return 1e300
'''


@pytest.fixture
def terms_module(tmp_path, monkeypatch):
    import sys

    (tmp_path / "reward_terms.py").write_text(TERMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "reward_terms", raising=False)
    return "reward_terms"


def _weighted_task(*functions, weights=None):
    from ftis_engine.config import RunConfig
    from ftis_engine.data.tasks import load_task

    weights = weights or [1.0] * len(functions)
    data = RunConfig.model_validate({
        "members": [{"name": "a", "model": "builtin:tiny-s"}],
        "data": {"task": "tiny-add", "rewards": [{"function": f, "weight": w} for f, w in zip(functions, weights)]},
    }).data
    return load_task(data, seed=0)


@pytest.mark.parametrize("name, said", [
    ("raises", r"raised KeyError: 'no such thing'"),
    ("nan", r"returned nan \(float\); a reward is a finite number"),
])
def test_a_failing_term_of_data_rewards_is_named_by_its_index_and_function(terms_module, name, said):
    from ftis_engine.data.tasks import Example
    from ftis_engine.data.tasks.base import RewardError

    from .test_admission import DigitTokenizer

    task = _weighted_task(f"{terms_module}:right", f"{terms_module}:{name}")
    with pytest.raises(RewardError, match=rf"^data.rewards.1: {terms_module}:{name}\('123', '7'\) {said}") as caught:
        task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")])
    assert "object at 0x" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_term_that_never_returns_is_named_at_data_reward_timeout_s(terms_module):
    from ftis_engine.data.tasks import Example
    from ftis_engine.data.tasks.base import RewardError

    from .test_admission import DigitTokenizer

    task = _weighted_task(f"{terms_module}:right", f"{terms_module}:sleeps")
    task.reward_timeout_s = 0.3
    with pytest.raises(RewardError, match=rf"^data.rewards.1: {terms_module}:sleeps\('123', '7'\) did not return "
                                          r"within 0.3 s \(data.reward_timeout_s\)"):
        task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")])


def test_data_rewards_terms_are_recorded_in_the_one_scoring_pass_and_logged_without_a_second(terms_module):
    import importlib
    import pickle
    import types

    import torch

    from ftis_engine.data.rollouts import Rollout
    from ftis_engine.run.step import reward_terms
    from ftis_engine.data.tasks import Example

    from .test_admission import DigitTokenizer

    task = _weighted_task(f"{terms_module}:right", f"{terms_module}:short", weights=[2.0, 0.5])
    task.train = [Example("q", "7")]
    calls = importlib.import_module(terms_module).calls
    completions = [[7], [1, 2, 3], [7, 7]]
    rewards = task.score(DigitTokenizer(), completions, [task.train[0]] * 3)
    assert rewards == [2.5, 0.0, 0.5] and len(calls) == 6  # each term once per completion
    rollouts = [Rollout(member=0, prompt_index=0, completion_ids=torch.tensor(ids), gen_logprobs=torch.zeros(len(ids)),
                        reward=reward, finish_reason="stop", policy_version=0)
                for ids, reward in zip(completions, rewards)]
    rollouts.append(Rollout(member=0, prompt_index=0, completion_ids=torch.tensor([7]), gen_logprobs=torch.zeros(1),
                            reward=float("nan"), finish_reason="stop", policy_version=0))  # unscored: left out
    swarm = types.SimpleNamespace(task=task)
    member = types.SimpleNamespace(tokenizer=DigitTokenizer())
    assert reward_terms(swarm, member, rollouts) == {f"reward/{terms_module}:right": pytest.approx(1 / 3),
                                                     f"reward/{terms_module}:short": pytest.approx(2 / 3)}
    assert len(calls) == 6  # the log scored nothing again
    assert [r.terms for r in rewards] == [{f"{terms_module}:right": 1.0, f"{terms_module}:short": 1.0},
                                          {f"{terms_module}:right": 0.0, f"{terms_module}:short": 0.0},
                                          {f"{terms_module}:right": 0.0, f"{terms_module}:short": 1.0}]
    assert pickle.loads(pickle.dumps(rewards[2])).terms == rewards[2].terms  # a sharded member gathers them


@pytest.mark.parametrize("rewards, field", [
    ("[{function: ftis_engine.data.rewards:tiny_answer_reward, weight: 1e300}]", "data.rewards.0.weight: 1e+300 is beyond"),
    ("[{function: ftis_engine.data.rewards:tiny_answer_reward, weight: 1e308}, "
     "{function: ftis_engine.data.rewards:tiny_answer_reward, weight: 1e308}]", "data.rewards.0.weight: 1e+308 is beyond"),
    ("[{function: ftis_engine.data.rewards:tiny_answer_reward, weight: -2e6}]", "data.rewards.0.weight: -2e+06 is beyond"),
])
def test_a_reward_weight_beyond_what_a_reward_carries_is_refused_naming_it(tmp_path, capsys, rewards, field):
    """A weight of 1e300 passed as finite, and the advantages came out inf (a ValueError from kernels/ftis_kernels/api.py)."""
    from .helpers import TINY, command_here

    done = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "runs", "--set",
                        f"data.rewards={rewards}")
    assert done.returncode == 2 and done.stderr.splitlines()[0].startswith(f"error: {field} +-1e+06"), done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_a_reward_or_a_weighted_sum_beyond_the_bound_stops_with_one_line_naming_it(terms_module):
    """Each term's value and the weighted sum are within +-1e6: a term of 1e300, or weights that carry two
    in-bound values past it, stop at scoring with the field named, before an advantage can overflow."""
    from ftis_engine.data.tasks import Example
    from ftis_engine.data.tasks.base import RewardError

    from .test_admission import DigitTokenizer

    task = _weighted_task(f"{terms_module}:right", f"{terms_module}:huge")
    with pytest.raises(RewardError, match=rf"^data.rewards.1: {terms_module}:huge\('123', '7'\) returned 1e\+300; "
                                          r"a reward is within \+-1e\+06"):
        task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")])
    task = _weighted_task(f"{terms_module}:short", f"{terms_module}:short", weights=[1e6, 1e6])
    with pytest.raises(RewardError, match=r"^data.rewards: the weighted sum of the terms\('7', '7'\) is 2e\+06; "):
        task.score(DigitTokenizer(), [[7]], [Example("q", "7")])
    assert task.score(DigitTokenizer(), [[1, 2, 3]], [Example("q", "7")]) == [0.0]  # in bounds: scored
