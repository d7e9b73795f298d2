"""Tasks: local JSONL data are read with errors naming the config field, the file and the line."""

from __future__ import annotations

import pytest

from ftis_engine.data.tasks import TaskError
from ftis_engine.data.tasks.math import load_examples

GOOD = '{"question": "1+1?", "answer": "it is #### 2"}\n'


@pytest.mark.parametrize("text, message", [
    ("", "holds no rows"),
    ("\n\n", "holds no rows"),
    (GOOD + '{"question": "2+2?", "answer": \n', "line 2 is not valid JSON"),
    (GOOD + "\n" + '{"question": "2+2?"}\n', "line 3 has no field 'answer' (it has: question)"),
    (GOOD + '["question", "answer"]\n', "line 2 is not a JSON object"),
    (GOOD + '{"question": "2+2?", "answer": "4"}\n', "line 2: a GSM8K answer must contain '####'"),
])
def test_a_bad_local_file_names_the_field_the_file_and_the_line(tmp_path, text, message):
    path = tmp_path / "train.jsonl"
    path.write_text(text)
    with pytest.raises(TaskError, match="data.train_path: ") as caught:
        load_examples("gsm8k-train", str(path), "data.train_path")
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_good_local_file_gives_its_examples_with_the_gold_answers(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(GOOD + "\n" + '{"question": "3*3?", "answer": "#### 1,009"}\n')
    examples = load_examples("gsm8k", str(path), "data.eval_paths.gsm8k")
    assert [(e.question, e.answer) for e in examples] == [("1+1?", "2"), ("3*3?", "1009")]
    path.write_bytes(b'{"problem": "1+1?", "answer": "1"}\n\xff\n')
    with pytest.raises(TaskError, match="line 2 is not UTF-8"):
        load_examples("math500", str(path), "data.eval_paths.math500")


# ----------------------------------------------------------------------------------------------- arith (the study testbed)

from ftis_engine.data.tasks import arith  # noqa: E402


@pytest.mark.parametrize("completion, gold, reward", [
    ("7+5=12,3+4+1=8;82", "82", 1.0),
    ("  7+5=12,3+4+1=8;82\n", "82", 1.0),  # white space around is allowed
    ("7+5=12,3+4+1=8;83", "82", 0.0),  # wrong answer
    ("82", "82", 0.0),  # no scratchpad
    (";82", "82", 0.0),  # empty scratchpad
    ("7+5=12;8;82", "82", 0.0),  # two separators
    ("7+5=12,3+4+1=8;82x", "82", 0.0),  # something after the answer
    ("7+5=12,3+4+1=8;", "82", 0.0),  # no answer
])
def test_the_scratchpad_reward_needs_the_format_and_the_answer(completion, gold, reward):
    assert arith.scratchpad_reward(completion, gold) == reward


@pytest.mark.parametrize("style, expected", [
    ("columns", "7+5=12,3+4+1=8;82"),
    ("carry-first", "5+7=12,1+4+3=8;82"),
    ("msd-first", "3+4=7,7+5=12;82"),
])
def test_a_worked_solution_adds_column_by_column_with_carries(style, expected):
    assert arith.solution("37+45=", style) == expected


def test_three_digit_solutions_carry_into_the_extra_column():
    assert arith.solution("995+17=", "columns") == "5+7=12,9+1+1=11,9+0+1=10;1012"
    # the shifted task: most significant column first, no carry written, the same answer
    assert arith.solution("995+17=", "msd-first") == "9+0=9,9+1=10,5+7=12;1012"


@pytest.mark.parametrize("style", arith.STYLES)
def test_every_demonstration_earns_the_reward_and_is_no_eval_question(style):
    task = arith.make_task(seed=0)
    held = {e.question for examples in task.evals.values() for e in examples}
    pairs = task.demonstrations(style, 300, seed=1)
    assert len(pairs) == 300 and not {q for q, _ in pairs} & held
    for question, completion in pairs:
        a, b = (int(x) for x in question.rstrip("=").split("+"))
        assert task.reward(completion, str(a + b)) == 1.0
    assert 0.15 < sum(len(q) > 6 for q, _ in pairs) / len(pairs) < 0.45  # OOD_SHARE of 3-digit questions


def test_the_two_styles_write_the_same_answer_differently_in_multi_token_completions():
    questions = [q for q, _ in arith.demonstrations("columns", 200, seed=0)]
    columns = [arith.solution(q, "columns") for q in questions]
    carry_first = [arith.solution(q, "carry-first") for q in questions]
    assert all(a.split(";")[1] == b.split(";")[1] for a, b in zip(columns, carry_first))
    assert sum(a != b for a, b in zip(columns, carry_first)) / len(questions) > 0.9
    assert sum(len(c) for c in columns) / len(columns) >= 8


def test_arith_eval_sets_are_fixed_disjoint_from_training_and_ood_is_longer():
    one, two = arith.make_task(seed=0), arith.make_task(seed=1)
    assert one.evals == two.evals and one.train != two.train
    assert set(one.evals) == {"arith", "arith-ood"} and all(len(v) == arith.EVAL_SIZE for v in one.evals.values())
    held = {e.question for v in one.evals.values() for e in v}
    assert not held & {e.question for e in one.train}
    assert all(len(e.question) == 6 for e in one.evals["arith"])  # "ab+cd="
    assert all(len(e.question) == 7 for e in one.evals["arith-ood"])  # "abc+de="


def test_an_unknown_style_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown style 'rows'"):
        arith.demonstrations("rows", 1, seed=0)


def test_gsm8k_calc_is_the_calculator_steps_of_gsm8ks_solutions_held_out_by_expression(shared_data):
    """gsm8k-calc: each distinct <<expression=result>> step of one or two operations with a whole-number result,
    "Compute <expression>." -> the result, whose value is the expression's (not the annotation's, which GSM8K
    sometimes rounds); eval steps that occur in a training solution are left out."""
    import json
    import re

    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task
    from ftis_engine.data.tasks.math import _evaluate

    from .helpers import TINY

    data = shared_data / "gsm8k"
    config = load_config(TINY, ["data.task=gsm8k-calc", f"data.train_path={data / 'train.jsonl'}",
                                f"data.eval_paths={{gsm8k-calc: {data / 'test.jsonl'}}}"])
    task = load_task(config.data, 0)
    assert list(task.evals) == ["gsm8k-calc"] and task.system_prompt.startswith("You are a calculator")
    assert len(task.train) > 5000 and len(task.evals["gsm8k-calc"]) > 500
    trained = {ex.question for ex in task.train}
    assert not trained & {ex.question for ex in task.evals["gsm8k-calc"]}
    assert len(trained) == len(task.train)  # distinct
    first = json.loads((data / "train.jsonl").open().readline())["answer"]  # "<<48/2=24>>" ...
    steps = re.findall(r"<<([^=<>]+)=", first)
    assert any(f"Compute {s.strip()}." in trained for s in steps)
    for example in task.train[:500]:
        expression = example.question.removeprefix("Compute ").removesuffix(".")
        assert 1 <= len(re.findall(r"(?<=[\d.)])\s*[-+*/]", expression)) <= 2
        assert str(int(_evaluate(expression))) == example.answer
    assert task.reward("Sure! 7*3 = 21.", "21") == 1.0 and task.reward("21 is it? no, 22", "21") == 0.0


@pytest.mark.parametrize("completion, gold, reward", [
    ("42", "42", 1.0), ("The result is 1,234.", "1234", 1.0), ("<answer>5</answer> then 6", "5", 1.0),
    ("<think>2+3</think><answer>5</answer>", "5", 1.0), ("3.50", "3.5", 1.0), ("-2", "-2", 1.0),
    ("no number here", "3", 0.0), ("4 and then 5", "4", 0.0), ("<answer></answer> 7", "7", 1.0),
])
def test_final_answer_reward_takes_the_last_answer_block_or_else_the_last_number(completion, gold, reward):
    from ftis_engine.data.rewards import final_answer_reward

    assert final_answer_reward(completion, gold) == reward


def test_a_data_line_nested_thousands_deep_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TaskError, match=r"^data.train_path: .*deep.jsonl line 2 is nested too deep to read$"):
        load_examples("gsm8k-train", str(path), "data.train_path")


@pytest.mark.parametrize("row, said", [
    ('{"question": null, "answer": "#### 1"}', r"its 'question' is null, not text"),
    ('{"question": NaN, "answer": "#### 1"}', r"its 'question' is NaN, not text"),
    ('{"question": "  ", "answer": "#### 1"}', r"its 'question' is \"  \", not text"),
    ('{"question": ["a"], "answer": "#### 1"}', r"its 'question' is \[\"a\"\], not text"),
    ('{"question": "q", "answer": null}', r"its 'answer' is null, not a number or text"),
])
def test_a_data_row_without_a_question_or_answer_is_refused_with_its_file_and_line(tmp_path, row, said):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "ok", "answer": "#### 2"}\n' + row + "\n")
    with pytest.raises(TaskError, match=rf"^data.train_path: .*d.jsonl line 2: {said}$"):
        load_examples("gsm8k-train", str(path), "data.train_path")


@pytest.mark.parametrize("override", ["data.train_path=/no/such/file.jsonl", "data.eval_paths={tiny-last: x.jsonl}"])
def test_a_data_path_for_a_built_in_task_is_refused_not_silently_ignored(override):
    from ftis_engine.config import ConfigError, load_config

    from .helpers import TINY

    # refused as the config loads (it was refused only when the task loaded)
    with pytest.raises(ConfigError, match=r"^data\.(train_path|eval_paths\.tiny-last): task tiny-last is built in "
                                          r"and reads no files"):
        load_config(TINY, [override])


def test_a_data_file_that_cannot_be_read_is_one_line(tmp_path):
    import os

    path = tmp_path / "secret.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n')
    path.chmod(0)
    for unreadable in ([str(path)] if os.geteuid() != 0 else []) + ["/proc/self/mem"]:
        with pytest.raises(TaskError, match=rf"^data.train_path: cannot read {unreadable} \("):
            load_examples("gsm8k-train", unreadable, "data.train_path")


def test_a_jsonl_task_takes_its_field_names_and_prompt_template_and_an_hf_one_its_splits(tmp_path):
    import json

    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    rows = [{"q": f"What is {i}+{i}?", "a": f"2x #### {2 * i}"} for i in range(6)]
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = ["data.question_field=q", "data.answer_field=a", "data.prompt_template=Q: {question} A?"]
    config = load_config(TINY, ["data.task=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}",
                                f"data.eval_paths={{mine: {tmp_path / 'test.jsonl'}}}", *fields])
    task = load_task(config.data, 0)
    assert task.train[2].question == "Q: What is 2+2? A?" and task.train[2].answer == "4"
    assert list(task.evals) == ["mine"] and len(task.evals["mine"]) == 6
    hf = load_config(TINY, ["data.task=hf", f"data.path={tmp_path}", "data.split=train",
                            "data.eval_paths={held: test}", *fields])
    task = load_task(hf.data, 0)
    assert [ex.answer for ex in task.train] == [str(2 * i) for i in range(6)] and len(task.evals["held"]) == 6
    with pytest.raises(TaskError, match=r"train.jsonl line 1 has no field 'nope' \(it has: q, a\)"):
        load_task(load_config(TINY, ["data.task=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}",
                                     "data.question_field=nope", "data.answer_field=a"]).data, 0)


def test_weighted_rewards_sum_their_terms_and_a_failing_term_is_named():
    from ftis_engine.config import ConfigError, load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    config = load_config(TINY, ["data.rewards=[{function: ftis_engine.data.rewards:tiny_answer_reward, weight: 2.0}, "
                                "{function: ftis_engine.data.rewards:final_answer_reward, weight: 0.5}]"])
    task = load_task(config.data, 0)
    assert task.reward("7", "7") == 2.5 and task.reward("x", "7") == 0.0
    assert task.reward.components("7", "7") == {"ftis_engine.data.rewards:tiny_answer_reward": 1.0,
                                               "ftis_engine.data.rewards:final_answer_reward": 1.0}
    with pytest.raises(ConfigError, match="give either data.reward or data.rewards"):
        load_config(TINY, ["data.reward=ftis_engine.data.rewards:tiny_answer_reward",
                           "data.rewards=[{function: ftis_engine.data.rewards:tiny_answer_reward}]"])
    with pytest.raises(ConfigError, match=r"data.prompt_template: must contain \{question\}"):
        load_config(TINY, ["data.prompt_template=no placeholder"])


# ------------------------------------------------------------------------------------------- data settings a task reads


def test_a_jsonl_file_that_starts_with_a_utf8_byte_order_mark_loads_from_line_1(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b'{"question": "3*3?", "answer": "#### 9"}\n')
    examples = load_examples("gsm8k-train", str(path), "data.train_path")
    assert [(e.question, e.answer) for e in examples] == [("1+1?", "2"), ("3*3?", "9")]


@pytest.mark.parametrize("overrides, field", [
    (["data.task=gsm8k", "data.prompt_template=Solve carefully: {question}"], "data.prompt_template"),
    (["data.task=gsm8k", "data.question_field=problem"], "data.question_field"),
    (["data.task=gsm8k", "data.answer_field=solution"], "data.answer_field"),
    (["data.task=gsm8k", "data.split=bogus"], "data.split"),
    (["data.task=gsm8k", "data.subset=main"], "data.subset"),
    (["data.task=math500", "data.train_path=t.jsonl", "data.question_field=problem"], "data.question_field"),
    (["data.task=jsonl", "data.train_path=t.jsonl", "data.split=test"], "data.split"),
    (["data.task=hf", "data.path=some/dataset", "data.train_path=t.jsonl"], "data.train_path"),
    (["data.task=tiny-last", "data.split=test"], "data.split"),
    (["data.task=arith", "data.prompt_template=Q: {question}"], "data.prompt_template"),
])
def test_a_data_setting_the_task_does_not_read_is_refused_as_the_config_loads(overrides, field):
    from ftis_engine.config import ConfigError, load_config

    from .helpers import TINY

    with pytest.raises(ConfigError, match=rf"^{field}: task [\w-]+ (does not read it|is built in and reads no) ") \
            as caught:
        load_config(TINY, overrides)
    assert "\n" not in str(caught.value)
    default = {"data.prompt_template": "{question}", "data.question_field": "question", "data.answer_field": "answer",
               "data.split": "train", "data.subset": "null", "data.train_path": "null"}[field]
    load_config(TINY, [*overrides[:-1], f"{field}={default}"])  # at its default it is no setting: a dumped config


def test_a_bad_data_setting_exits_2_with_one_line_naming_it(capsys):
    from .helpers import TINY, command_here

    done = command_here(capsys, "train", "--config", TINY, "--set", "data.task=gsm8k", "--set", "data.split=bogus",
                        "--dry-run")
    assert done.returncode == 2 and done.stderr.startswith("error: data.split: task gsm8k does not read it")
    assert len(done.stderr.strip().splitlines()) == 1


def _gsm8k_files(tmp_path, name: str, count: int, offset: int = 0) -> str:
    import json

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"question": f"{name} {i}+{i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(offset, offset + count)))
    return str(path)


def test_an_eval_path_for_a_set_the_run_does_not_evaluate_is_refused_naming_it(tmp_path):
    import json

    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    math500 = tmp_path / "math500.jsonl"
    math500.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    config = load_config(TINY, ["data.task=gsm8k", f"data.train_path={_gsm8k_files(tmp_path, 'train', 4)}",
                                f"data.eval_paths={{gsm8k: {_gsm8k_files(tmp_path, 'test', 2)}, math500: {math500}}}",
                                "eval.datasets=[gsm8k]"])
    with pytest.raises(TaskError, match=r"^data.eval_paths.math500: math500 is not evaluated \(eval sets: gsm8k\); "
                                        r"drop the entry, or add math500 to eval.datasets$"):
        load_task(config.data, 0, config.eval.datasets)
    assert list(load_task(config.data, 0, ["gsm8k", "math500"]).evals) == ["gsm8k", "math500"]
    hf = load_config(TINY, ["data.task=jsonl", f"data.train_path={_gsm8k_files(tmp_path, 'train', 4)}",
                            f"data.eval_paths={{held: {_gsm8k_files(tmp_path, 'test', 2)}, other: {math500}}}",
                            "eval.datasets=[held]"])
    with pytest.raises(TaskError, match=r"^data.eval_paths.other: other is not evaluated"):
        load_task(hf.data, 0, hf.eval.datasets)


def test_math500_trains_only_on_a_training_file_never_on_its_own_eval_set(tmp_path, caplog):
    import json

    from ftis_engine.config import ConfigError, load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    with pytest.raises(ConfigError, match=r"^data.train_path: task math500 needs a training file: MATH-500's 500 "
                                          r"problems are its eval set, never trained on"):
        load_config(TINY, ["data.task=math500"])

    def rows(name, problems):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"problem": p, "answer": str(len(p))}) + "\n" for p in problems))
        return path

    evaluated = rows("math500", ["What is a?", "What is bb?"])
    train = rows("train", ["What is ccc?", "What is a?", "What is dddd?"])  # MATH's test split holds MATH-500's
    config = load_config(TINY, ["data.task=math500", f"data.train_path={train}",
                                f"data.eval_paths={{math500: {evaluated}}}"])
    with caplog.at_level("WARNING", logger="ftis_engine"):
        task = load_task(config.data, 0)
    assert [ex.question for ex in task.train] == ["What is ccc?", "What is dddd?"]
    assert [ex.question for ex in task.evals["math500"]] == ["What is a?", "What is bb?"]
    assert "1 of the 3 problems" in caplog.text and "left out of the training set" in caplog.text
    with pytest.raises(TaskError, match=r"^data.train_path: every problem of .*math500.jsonl is a MATH-500 eval"):
        load_task(load_config(TINY, ["data.task=math500", f"data.train_path={evaluated}",
                                     f"data.eval_paths={{math500: {evaluated}}}"]).data, 0)
    # evaluated elsewhere, MATH-500 is still held out (its path is read for that): the training set does not
    # depend on eval.datasets, which a resume may change
    elsewhere = load_config(TINY, ["data.task=math500", f"data.train_path={train}", "eval.datasets=[gsm8k]",
                                   f"data.eval_paths={{gsm8k: {_gsm8k_files(tmp_path, 'test', 2)}, "
                                   f"math500: {evaluated}}}"])
    task = load_task(elsewhere.data, 0, elsewhere.eval.datasets)
    assert [ex.question for ex in task.train] == ["What is ccc?", "What is dddd?"] and list(task.evals) == ["gsm8k"]


@pytest.mark.parametrize("template, said", [
    ("{question.foo}", r"only \{question\} may be filled in, as it is \(it has \{question.foo\}\)"),
    ("{question:{question}}", r"only \{question\} may be filled in, as it is \(it has \{question:\{question\}\}\)"),
    ("{question[0]}", r"only \{question\} may be filled in"),
    ("{question!r}", r"only \{question\} may be filled in"),
    ("{question:d}", r"only \{question\} may be filled in"),
    ("Q: {question} {", r"Single '\{' encountered in format string; write a literal brace as \{\{ or \}\}"),
    ("Q: {0} {question}", r"only \{question\} may be filled in, as it is \(it has \{0\}\)"),
])
def test_a_prompt_template_that_cannot_take_every_question_is_one_line_naming_the_field(template, said):
    from ftis_engine.config import ConfigError, load_config

    from .helpers import TINY

    with pytest.raises(ConfigError, match=rf"^data.prompt_template: {said}") as caught:
        load_config(TINY, ["data.task=jsonl", "data.train_path=t.jsonl", f"data.prompt_template={template}"])
    assert "\n" not in str(caught.value)
    ok = load_config(TINY, ["data.task=jsonl", "data.train_path=t.jsonl", "data.prompt_template={{x}} {question}?"])
    assert ok.data.prompt_template.format(question="q") == "{x} q?"


def _two_config_dataset(root):
    """A local dataset folder whose README declares two configs (datasets reads them offline)."""
    import json

    for config, base in (("easy", 1), ("hard", 100)):
        (root / config).mkdir(parents=True)
        for split in ("train", "test"):
            (root / config / f"{split}.jsonl").write_text("".join(
                json.dumps({"q": f"{base + i}+{base + i}?", "a": f"#### {2 * (base + i)}"}) + "\n" for i in range(3)))
    files = "".join(f"- config_name: {c}\n  data_files:\n" + "".join(
        f"  - split: {s}\n    path: {c}/{s}.jsonl\n" for s in ("train", "test")) for c in ("easy", "hard"))
    (root / "README.md").write_text(f"---\nconfigs:\n{files}---\n")
    return root


def test_an_hf_dataset_with_several_configs_loads_the_one_data_subset_names(tmp_path, monkeypatch):
    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = _two_config_dataset(tmp_path / "two")
    settings = ["data.task=hf", f"data.path={root}", "data.question_field=q", "data.answer_field=a",
                "data.eval_paths={held: test}"]
    task = load_task(load_config(TINY, [*settings, "data.subset=hard"]).data, 0)
    assert [ex.answer for ex in task.train] == ["200", "202", "204"] and len(task.evals["held"]) == 3
    with pytest.raises(TaskError, match=r"^data.subset: '.*two' has several configs and data.subset names none; "
                                        r"name one of \['easy', 'hard'\]$"):
        load_task(load_config(TINY, settings).data, 0)
    with pytest.raises(TaskError, match=r"^data.subset: '.*two' has no config 'medium'"):
        load_task(load_config(TINY, [*settings, "data.subset=medium"]).data, 0)
    with pytest.raises(TaskError, match=r"^data.split: cannot load '.*two' config 'easy' \(data.subset\) split "
                                        r"'bogus' \(data.split\): Unknown split"):
        load_task(load_config(TINY, [*settings, "data.subset=easy", "data.split=bogus"]).data, 0)
    with pytest.raises(TaskError, match=r"^data.path: cannot load '.*nowhere' split 'train' \(data.split\)"):
        load_task(load_config(TINY, [*settings, f"data.path={tmp_path / 'nowhere'}"]).data, 0)


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line_naming_the_field_and_its_local_copy(monkeypatch):
    """GSM8K from the hub: whatever `datasets` raises (here a refused connection) is the field's one line."""
    import datasets

    from ftis_engine.data.tasks.math import load_rows

    def refused(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", refused)
    with pytest.raises(TaskError, match=r"^data.eval_paths.gsm8k: cannot load 'openai/gsm8k' from the HF hub "
                                        r"\(Couldn't reach 'openai/gsm8k' on the Hub \(LocalEntryNotFoundError\)\); "
                                        r"give a local copy with data.eval_paths.gsm8k$"):
        load_rows("gsm8k", None, "data.eval_paths.gsm8k")


# ----------------------------------------------------------------------------------------------- data that is not text


def test_a_byte_that_is_not_utf8_is_named_by_its_line():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "train.jsonl"
        path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() * 2 + b'{"question": "1+\xff?", "answer": "#### 2"}\n')
        with pytest.raises(TaskError, match=rf"^data.train_path: {path} line 3 is not UTF-8 text \(invalid start "
                                            r"byte: 0xff at byte 17 of the line\)$"):
            load_examples("gsm8k-train", str(path), "data.train_path")


def test_a_question_holding_a_lone_surrogate_is_one_line_naming_its_line_not_a_tokenizer_traceback(tmp_path, capsys):
    """JSON's "\\ud800" without its pair decodes to a string no tokenizer can encode: it raised TypeError in
    context.prompt_ids after the models were loaded."""
    from .helpers import TINY, command_here

    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "1+2=", "answer": "3"}\n{"question": "\\ud800 12=", "answer": "3"}\n')
    done = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "runs", "--set",
                        "data.task=jsonl", "--set", f"data.train_path={path}")
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: data.train_path: {path} line 2: its 'question' holds '\\ud800' at character 1: a lone surrogate (a "
        "JSON \\ud800-\\udfff escape without its pair), which no text or tokenizer holds"), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


def _parquet(folder, question) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder.mkdir()
    pq.write_table(pyarrow.table({"question": question, "answer": ["3", "4"]}), folder / "train.parquet")


def test_a_binary_question_column_is_named_with_its_type_not_a_crash_of_the_message(tmp_path):
    """A parquet column of bytes: the code building the message crashed (json.dumps(bytes))."""
    from ftis_engine.config import load_config
    from ftis_engine.data.tasks import load_task

    from .helpers import TINY

    _parquet(tmp_path / "binary", [b"1+2=", b"2+2="])
    config = load_config(TINY, ["data.task=hf", f"data.path={tmp_path / 'binary'}"])
    with pytest.raises(TaskError, match=r"^data.path: .*binary train row 1: its 'question' is bytes b'1\+2=', not "
                                        r"text$"):
        load_task(config.data, 0)


@pytest.mark.parametrize("content, said", [
    (b"", "is empty (0 bytes); remove it or write its rows"),
    (b"not parquet at all" * 10, "is not a Parquet file (180 bytes without Parquet's PAR1 marks at its start and end"),
    (None, "is not a Parquet file"),  # a real one, cut short
])
def test_an_empty_or_broken_parquet_file_is_one_line_naming_it(tmp_path, capsys, content, said):
    """datasets printed its own ERROR line, then ours said a generic 'cannot load' that never said the file is
    empty."""
    from .helpers import TINY, command_here

    folder = tmp_path / "data"
    _parquet(folder, ["1+2=", "2+2="])
    file = folder / "train.parquet"
    file.write_bytes(file.read_bytes()[:-10] if content is None else content)
    done = command_here(capsys, "train", "--config", TINY, "--output-dir", tmp_path / "runs", "--set",
                        "data.task=hf", "--set", f"data.path={folder}")
    errors = [line for line in done.stderr.splitlines() if not line.startswith("run directory: ")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: data.path: {file} {said}"), \
        done.stderr


def test_the_configs_table_of_tasks_names_every_built_in_task_and_no_other():
    """config/tasks.py names the built-in tasks without loading them (the config is a leaf): its names agree with
    the tasks data/tasks/ builds, and a name it does not know is one load_task refuses."""
    from ftis_engine.config import tasks as table
    from ftis_engine.data.tasks import math as math_tasks
    from ftis_engine.data.tasks import tiny

    assert table.TINY_TASKS == tuple(tiny.TINY_TASKS) and table.MATH_TASKS == tuple(math_tasks.MATH_TASKS)
    assert table.settings_read("nope") is None
    assert table.settings_read("gsm8k-calc") == {"train_path", "eval_paths"}
    assert table.readers("path") == "hf"
