"""binary_answer_reward (docs/algorithm.md, section 2) on the real GSM8K and MATH-500 answers, and the format rules."""

from __future__ import annotations

import json

import pytest

from ftis_engine.rewards import binary_answer_reward, extract_answer, load_reward, tiny_answer_reward
from ftis_engine.tasks.math import gsm8k_gold


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
    assert load_reward("ftis_engine.rewards:tiny_answer_reward") is tiny_answer_reward
    assert load_reward("ftis_engine.rewards.tiny_answer_reward") is tiny_answer_reward
    with pytest.raises(ValueError):
        load_reward("ftis_engine.rewards:nothing_here")


def test_a_math_verify_time_out_is_no_verdict_not_a_zero(monkeypatch):
    import math_verify
    from math_verify.errors import TimeoutException

    from ftis_engine.rewards import RewardTimeout

    def slow_parse(*args, **kwargs):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(math_verify, "parse", slow_parse)
    with pytest.raises(RewardTimeout, match="timed out"):
        binary_answer_reward("<think>x</think><answer>12</answer>", "12")
    assert binary_answer_reward("no tags at all", "12") == 0.0  # nothing to parse: a verdict
