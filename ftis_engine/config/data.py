"""The data section of the run configuration: the task, its files or dataset fields (a field the task does not
read, set away from its default, is refused), the prompt and the rewards."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from ..core.limits import MAX_REWARD
from .tasks import readers, settings_read
from .types import Section


class RewardTerm(Section):
    function: str = Field(..., min_length=1, description="A reward as 'module:function' (completion, gold) -> float, "
                          "e.g. ftis_engine.data.rewards:binary_answer_reward.")
    weight: float = Field(1.0, allow_inf_nan=False, description=f"Its weight in the sum, within +-{MAX_REWARD:g} "
                          "(as every reward and the sum: group advantages do not depend on the rewards' scale).")

    @field_validator("weight")
    @classmethod
    def _a_weight_a_reward_can_carry(cls, value: float) -> float:
        if abs(value) > MAX_REWARD:
            raise ValueError(f"{value:g} is beyond +-{MAX_REWARD:g}, the bound of a reward and of the weighted sum "
                             "(group advantages do not depend on the rewards' scale, so no weight needs more; a weight "
                             "of 1e300 made the advantages inf)")
        return value


def _unread(task: Any, field: str) -> str | None:
    """Why a data field set away from its default has no effect for `task` (None: the task reads it, or is unknown:
    load_task reports that)."""
    read = settings_read(task) if isinstance(task, str) else None
    if read is None or field in read:
        return None
    if not read:
        return f"task {task} is built in and reads no files or dataset fields; drop it (tasks that read it: " \
               f"{readers(field)})"
    return f"task {task} does not read it (tasks that do: {readers(field)}); drop it"


def _eval_path_read(value: str, info) -> str:
    """One data.eval_paths entry (its key in the error's location): only for a task that reads eval files or
    splits. (Whether the run evaluates that set depends on eval.datasets: load_task checks it.)"""
    why = _unread(info.data.get("task"), "eval_paths")
    if why:
        raise ValueError(why)
    return value


_EvalPath = typing.Annotated[str, AfterValidator(_eval_path_read)]
_PROMPT_SAMPLE = "Natalia sold clips to 48 of her friends in April. How many clips did she sell? {x} 100%"


class DataSettings(Section):
    task: str = Field(
        "gsm8k", description="gsm8k | math500 (its training set is data.train_path: MATH-500 itself is the eval set) | "
                   "gsm8k-calc | arith (the study testbed: addition with a scratchpad) | "
                   "tiny-last | tiny-add | jsonl (any JSONL files: data.train_path, data.eval_paths, the field "
                   "names below) | hf (any HF dataset: data.path, data.subset, data.split; eval_paths name other "
                   "splits). A data field the task does not read, set away from its default, is refused."
    )
    train_path: str | None = Field(
        None, validate_default=True,
        description="Local JSONL for the training split (gsm8k, gsm8k-calc: default the HF hub's; math500: required, "
                    "e.g. MATH's train split with problem and answer fields; MATH-500's eval problems in it are left "
                    "out; jsonl: required).")
    eval_paths: dict[str, _EvalPath] = Field(
        default_factory=dict, description="Local JSONL per eval dataset name, e.g. {gsm8k: ..., math500: ...}; for "
                                          "task hf, eval set name -> split of data.path. Every entry must be an eval "
                                          "set the run evaluates (eval.datasets).")
    path: str | None = Field(None, description="task hf: the dataset (a hub id, or a local directory of data "
                             "files, read through `datasets`).")
    subset: str | None = Field(None, min_length=1, description="task hf: the dataset's config (datasets' `name`), "
                               "needed when it has several, e.g. main for openai/gsm8k.")
    split: str = Field("train", min_length=1, description="task hf: the training split.")
    question_field: str = Field("question", min_length=1, description="task jsonl / hf: the question's field.")
    answer_field: str = Field("answer", min_length=1, description="task jsonl / hf: the gold answer's field (a GSM8K "
                              "style '#### answer' is cut to the answer).")
    prompt_template: str = Field("{question}", description="task jsonl / hf: the user message, with {question} for "
                                 "the question's text.")
    rewards: list[RewardTerm] = Field(
        default_factory=list, description="Several rewards with weights, summed (TRL's reward_funcs and "
        "reward_weights); each term's mean is logged as reward/<function>. Replaces the task's training reward (and "
        "data.reward, which may not be given with it); eval still counts right answers (eval.reward).")

    @field_validator("prompt_template")
    @classmethod
    def _fills_in_only_the_question(cls, value: str) -> str:
        import string

        brace = "; write a literal brace as {{ or }}"
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(value)
                      if name is not None]
        except ValueError as exc:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ValueError(f"{exc}{brace}") from None
        for name, spec, conversion in fields:
            if name != "question" or spec or conversion:  # {question.x}, {0}, {question:{question}}, {question!r}
                written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise ValueError(f"only {{question}} may be filled in, as it is (it has {written}){brace}")
        if not fields:
            raise ValueError("must contain {question}")
        try:
            value.format(question=_PROMPT_SAMPLE)
        except Exception as exc:  # whatever the parse above let through that a question's text cannot fill in
            # from None: a one-line error for the user; the cause adds nothing to it
            raise ValueError(f"cannot be filled in with a question ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:100]}){brace}") from None
        return value

    @field_validator("train_path", "path", "subset", "split", "question_field", "answer_field", "prompt_template")
    @classmethod
    def _read_by_the_task(cls, value: Any, info) -> Any:
        task = info.data.get("task")
        if info.field_name == "train_path" and task == "math500" and value is None:
            raise ValueError("task math500 needs a training file: MATH-500's 500 problems are its eval set, never "
                             "trained on; give one with problem and answer fields (e.g. MATH's train split)")
        why = _unread(task, info.field_name) if value != cls.model_fields[info.field_name].default else None
        if why:
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _one_reward_setting(self) -> DataSettings:
        if self.rewards and self.reward is not None:
            raise ValueError("data.rewards: give either data.reward or data.rewards, not both")
        return self
    system_prompt: str | None = Field(None, description="System prompt; default: the paper's <think>/<answer> prompt.")
    prompt_format: Literal["auto", "chat", "plain"] = Field("auto", description="chat: the tokenizer's chat template; "
                                                            "plain: system + question text; auto: chat if available.")
    reward: str | None = Field(None, description="The training reward as 'module:function' (completion, gold) -> "
                               "float, instead of the task's; eval still counts right answers (eval.reward).")
    reward_timeout_s: float | None = Field(
        60.0, gt=0, allow_inf_nan=False, description="A reward call (one completion) that has not returned after "
        "this many seconds stops the run with one line naming the reward and the completion; null: no bound. It "
        "interrupts Python code and waits (sleep, sockets), not one C call that never yields (a runaway regex).")
    max_prompt_tokens: int = Field(512, ge=1, description="Longer prompts are dropped from the training set.")
    shuffle: bool = Field(True, description="Shuffle the training prompts (each epoch, by the run seed).")
