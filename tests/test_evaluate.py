"""Eval's greedy pass@1 counts right answers by the task's answer check, never the training reward."""

from __future__ import annotations

import types

import pytest

from ftis_engine.model.fsdp import Shard
from ftis_engine.run.evaluate import count_passes, evaluate_member
from ftis_engine.data.tasks import load_task


class CharTokenizer:
    """One token per character (its code point); no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(chr(i) for i in ids) for ids in sequences]


def fake_member(answers: dict[str, str]):
    """A member whose greedy completion of a prompt ending in a question is answers[question]."""
    tokenizer = CharTokenizer()

    def greedy(prompts, max_new_tokens, on_batch=None):
        texts = tokenizer.batch_decode(prompts)
        return [[ord(c) for c in next(a for q, a in answers.items() if t.rstrip().endswith(q))] for t in texts]

    return types.SimpleNamespace(tokenizer=tokenizer, generator=types.SimpleNamespace(greedy=greedy),
                                 shard=Shard.whole())


USER_REWARDS = '''
def well_formatted(completion, gold):
    return float(completion.startswith("<think>") and completion.endswith("</answer>"))


def always_one(completion, gold):
    return 1.0


def boxed(completion, gold):
    return float(completion.strip() == "\\\\boxed{" + gold + "}")
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_checks.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_checks"


def _task(tmp_path, *overrides, eval_reward=None):
    import json

    from ftis_engine.config import load_config

    from .helpers import TINY

    rows = [{"question": "What is 2+2?", "answer": "#### 4"}, {"question": "What is 3+3?", "answer": "#### 6"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(TINY, ["data.task=jsonl", f"data.train_path={path}", f"data.eval_paths={{held: {path}}}",
                                *overrides])
    return load_task(config.data, 0, eval_reward=eval_reward)


RIGHT = "<think>2+2 is 4</think><answer>4</answer>"
WRONG = "<think>3+3 is 5</think><answer>5</answer>"  # well formatted, wrong


def test_a_wrong_well_formatted_answer_is_no_pass_whatever_the_training_rewards_pay(tmp_path, user_rewards):
    task = _task(tmp_path, "data.rewards=[{function: ftis_engine.data.rewards:binary_answer_reward, weight: 0.5}, "
                           f"{{function: {user_rewards}:well_formatted, weight: 1.0}}]")
    member = fake_member({"What is 2+2?": RIGHT, "What is 3+3?": WRONG})
    examples = task.evals["held"]
    assert task.score(member.tokenizer, [[ord(c) for c in WRONG]], [examples[1]]) == [1.0]  # the training reward
    assert count_passes(member, task, examples, 16) == (1, 0)
    assert evaluate_member(member, task, examples, 16) == (0.5, None)


def test_a_right_answer_passes_though_the_training_weights_sum_below_one(tmp_path):
    binary = "ftis_engine.data.rewards:binary_answer_reward"
    task = _task(tmp_path, f"data.rewards=[{{function: {binary}, weight: 0.6}}, {{function: {binary}, weight: 0.3}}, "
                           f"{{function: {binary}, weight: 0.1}}]")
    member = fake_member({"What is 2+2?": RIGHT, "What is 3+3?": RIGHT.replace("4", "6")})
    trained = task.score(member.tokenizer, [[ord(c) for c in RIGHT]], [task.evals["held"][0]])[0]
    assert trained == 0.9999999999999999  # the training reward of a right answer: below 1
    assert evaluate_member(member, task, task.evals["held"], 16)[0] == 1.0


def test_a_custom_data_reward_trains_and_eval_keeps_the_tasks_check_unless_eval_reward_names_one(tmp_path,
                                                                                                user_rewards):
    member = fake_member({"What is 2+2?": RIGHT, "What is 3+3?": WRONG})
    task = _task(tmp_path, f"data.reward={user_rewards}:always_one")
    assert task.score(member.tokenizer, [[ord(c) for c in WRONG]], [task.evals["held"][1]]) == [1.0]
    assert evaluate_member(member, task, task.evals["held"], 16)[0] == 0.5  # binary_answer_reward: the task's check
    boxed = fake_member({"What is 2+2?": "\\boxed{4}", "What is 3+3?": "\\boxed{6}"})
    assert evaluate_member(boxed, task, task.evals["held"], 16)[0] == 0.0
    mine = _task(tmp_path, f"data.reward={user_rewards}:always_one", eval_reward=f"{user_rewards}:boxed")
    assert evaluate_member(boxed, mine, mine.evals["held"], 16)[0] == 1.0
    with pytest.raises(ValueError, match=r"^eval.reward: 'user_checks:nothing' is not a callable"):
        _task(tmp_path, eval_reward=f"{user_rewards}:nothing")


@pytest.mark.parametrize("task_name, check", [
    ("gsm8k-calc", "final_answer_reward"), ("arith", "scratchpad_reward"), ("tiny-last", "tiny_answer_reward"),
])
def test_every_task_keeps_its_own_answer_check_for_eval_under_a_custom_training_reward(task_name, check, tmp_path,
                                                                                      shared_data):
    from ftis_engine.config import load_config

    from .helpers import TINY

    files = [f"data.train_path={shared_data / 'gsm8k' / 'train.jsonl'}",
             f"data.eval_paths={{gsm8k-calc: {shared_data / 'gsm8k' / 'test.jsonl'}}}"] if task_name == "gsm8k-calc" \
        else []
    config = load_config(TINY, [f"data.task={task_name}", *files,
                                "data.reward=ftis_engine.data.rewards:tiny_answer_reward"])
    task = load_task(config.data, 0, with_train=False)
    assert task.check.__name__ == check and task.reward.__name__ == "tiny_answer_reward"


def test_a_run_evaluates_with_eval_reward_and_trains_with_data_reward(tmp_path):
    """open_run hands eval.reward to the task: the run's eval check is the one named there, its training reward
    data.reward's (a run built without it would keep the task's own check)."""
    from ftis_engine.run.session import Start, open_run

    from .helpers import short_config

    swarm, _ = open_run(short_config("data.reward=tests.real_rewards:starts_with_a_number",
                                     "eval.reward=tests.real_rewards:contains_a_digit"), Start(tmp_path / "run"))
    swarm.close()
    assert swarm.task.check.__name__ == "contains_a_digit"
    assert swarm.task.reward.__name__ == "starts_with_a_number"
