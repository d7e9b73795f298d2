"""Tasks: local JSONL data are read with errors naming the config field, the file and the line."""

from __future__ import annotations

import pytest

from ftis_engine.tasks import TaskError
from ftis_engine.tasks.math import load_examples

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
    path.write_bytes(b'{"question": "\\xff", "answer": "1"}\n\xff\n')
    with pytest.raises(TaskError, match="not UTF-8"):
        load_examples("math500", str(path), "data.eval_paths.math500")
