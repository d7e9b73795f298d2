"""Config loading, dotted overrides and the errors that name the field."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from ftis_engine.config import ConfigError, RunConfig, dump_config, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def test_tiny_default_loads_with_documented_fields():
    cfg = load_config(TINY)
    assert cfg.algorithm.method == "f-tis" and cfg.collaboration == "vertical"
    assert len(cfg.members) >= 2 and any(m.lora for m in cfg.members)
    assert len({m.model for m in cfg.members}) >= 2  # different sizes
    for name, field in RunConfig.model_fields.items():
        assert field.description, f"{name} has no description"


def test_every_field_of_every_section_has_a_description():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            annotation = field.annotation
            for candidate in getattr(annotation, "__args__", ()) + (annotation,):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    walk(candidate, f"{prefix}{name}.")

    walk(RunConfig)


def test_dotted_overrides_reach_nested_fields_and_list_items():
    cfg = load_config(TINY, ["members.1.lr=0.5", "algorithm.method=gepo", "rollout.group_size=4",
                             "members.0.lora.r=8", "eval.datasets=[tiny-last]", "members.-1.name=last"])
    assert cfg.members[1].lr == 0.5 and cfg.algorithm.method == "gepo" and cfg.rollout.group_size == 4
    assert cfg.members[0].lora.r == 8  # a section created by the override, its other fields defaulted
    assert cfg.eval.datasets == ["tiny-last"] and cfg.members[-1].name == "last"


def test_attention_choices_reach_the_model_loader():
    from ftis_engine.member.members import attention_implementation

    cfg = load_config(TINY, ["train.attn_implementation=flex_attention"])
    assert attention_implementation(cfg.train.attn_implementation, torch.device("cuda")) == "flex_attention"
    assert attention_implementation("auto", torch.device("cpu")) == "sdpa"


def test_dump_round_trips(tmp_path):
    cfg = load_config(TINY, ["algorithm.kl_threshold=5"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["algorithm.method=ppo"], "algorithm.method"),
        (["algorithm.kl_reduction=padded_mean"], "algorithm"),
        (["members.0.lr=-1"], "members.0.lr"),
        (["members.0.generator=sglang"], "members.0.generator"),
        (["members.7.lr=1"], "members.7"),
        (["members.x.lr=1"], "members.x"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["collaboration=diagonal"], "collaboration"),
        (["algorihtm.method=tis"], "algorihtm"),
        (["members.0.colour=red"], "members.0.colour"),
        (["train.steps=0"], "train.steps"),
        (["members.1.name=tiny-s"], "members"),
        (["run_name=a/b"], "run_name"),
        (["run_name=.."], "run_name"),
        (["run_name=.hidden"], "run_name"),
        (["members.0.name=../../../../ESCAPED"], "members.0.name"),
        (["members.0.name=a/b"], "members.0.name"),
        (["members.1.name=-rf"], "members.1.name"),
        (["rollout.group_size=1000000000"], "rollout.group_size"),
        (["rollout.prompts_per_step=1000000000"], "rollout.prompts_per_step"),
        (["rollout.max_new_tokens=1000000000"], "rollout.max_new_tokens"),
        (["nonsense"], "nonsense"),
        (["collaboration=horizontal", "rollout.group_size=1"], "rollout.group_size"),
        (["train.attn_implementation=flash_attention_3"], "train.attn_implementation"),
        (["algorithm.is_level=batch"], "algorithm.is_level"),
        (["algorithm.is_min=5"], "algorithm.is_min"),
        (["algorithm.delta=1.0"], "algorithm.delta"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip"),
        (["algorithm.reject=mean"], "algorithm.reject_max"),
        (["algorithm.reject=geometric"], "algorithm.reject"),
    ],
)
def test_bad_values_raise_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    message = str(info.value)
    assert field in message and "\n" not in message


def test_a_config_saved_as_utf16_or_with_a_utf8_mark_loads_and_other_bytes_are_one_line(tmp_path):
    text = TINY.read_text()
    for encoding in ("utf-16", "utf-8-sig"):
        path = tmp_path / f"{encoding}.yaml"
        path.write_bytes(text.encode(encoding))
        assert load_config(path) == load_config(TINY)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("run_name: caf\xe9\n".encode("latin-1") + text.encode())
    with pytest.raises(ConfigError, match="is not UTF-8 .* text; save it as UTF-8"):
        load_config(latin)


def test_a_completion_longer_than_the_models_context_is_refused_before_anything_runs(tmp_path):
    from ftis_engine.run.preflight import check_members
    from ftis_engine.run.session import Start, open_run

    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens: 1024 new tokens exceed members.0.model's "
                                          r"context of 1024 tokens"):
        check_members(load_config(TINY, ["rollout.max_new_tokens=1024"]))  # cannot fit after any prompt
    with pytest.raises(ConfigError, match=r"^eval.max_new_tokens: 2000 new tokens"):
        check_members(load_config(TINY, ["eval.max_new_tokens=2000"]))
    # after the data is read: the longest prompt the run uses (a few tokens here) plus the completion
    config = load_config(TINY, ["rollout.max_new_tokens=1020", "eval.max_samples=4"])
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens: 1020 new tokens after the longest prompt of \d+ "
                                          r"tokens \(data.max_prompt_tokens=512 bounds them\) exceed"):
        open_run(config, Start(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("members: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    empty_members = tmp_path / "empty.yaml"
    empty_members.write_text("members: []\n")
    with pytest.raises(ConfigError, match="members"):
        load_config(empty_members)


@pytest.mark.parametrize("override, field", [
    ("algorithm.kl_threshold=.nan", "algorithm.kl_threshold"),
    ("algorithm.eps_high=.inf", "algorithm.eps_high"),
    ("rollout.temperature=.inf", "rollout.temperature"),
    ("algorithm.is_cap=.nan", "algorithm.is_cap"),
])
def test_non_finite_loss_settings_are_refused_at_load_time(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(TINY, [override])


def test_an_infinite_kl_threshold_disables_the_filter():
    assert load_config(TINY, ["algorithm.kl_threshold=.inf"]).algorithm.kl_threshold == float("inf")


@pytest.mark.parametrize("override, field, value", [
    ("data.system_prompt=Think step by step: then answer.", "system_prompt", "Think step by step: then answer."),
    ("data.system_prompt=Solve it. #1 rule: be brief", "system_prompt", "Solve it. #1 rule: be brief"),
    ("data.system_prompt=[not, a, list]", "system_prompt", "[not, a, list]"),
    ("data.system_prompt=null", "system_prompt", None),
    ("run_name=1.10", "run_name", "1.10"),
    ("run_name=2024-01-05", "run_name", "2024-01-05"),
    ("algorithm.method=tis", "method", "tis"),
    ("members.0.lr=1e-4", "lr", 1e-4),
    ("members.1.lora.target_modules=[q_proj]", "target_modules", ["q_proj"]),
])
def test_a_string_fields_override_is_the_text_as_typed_and_others_are_yaml(override, field, value):
    config = load_config(TINY, [override])
    section = {"system_prompt": config.data, "run_name": config, "method": config.algorithm,
               "lr": config.members[0], "target_modules": config.members[1].lora}[field]
    assert getattr(section, field) == value


@pytest.mark.parametrize("override, field", [("members.0.lr=yes", "members.0.lr"), ("train.steps=true", "train.steps"),
                                             ("seed=on", "seed"), ("members.0.vllm.sleep_level=true",
                                                                   "members.0.vllm.sleep_level"),
                                             ("train.threads=false", "train.threads")])
def test_a_yaml_boolean_never_becomes_a_number(override, field):
    with pytest.raises(ConfigError, match=rf"^{field}: expected a number, got the boolean"):
        load_config(TINY, [override])


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("run_name: x\nmembers:\n- name: a\n  model: builtin:tiny-s\ntrain:\n  steps: 2\n"
                    "train:\n  threads: 1\n")
    with pytest.raises(ConfigError, match=r"--config .*dup.yaml: key 'train' is given twice in one section "
                                          r"\(lines 5 and 7\); keep one$"):
        load_config(path)
    path.write_text("run_name: x\nmembers:\n- name: a\n  model: builtin:tiny-s\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice in one section \(lines 5 and 6\)"):
        load_config(path)


def test_a_config_nested_thousands_deep_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match=r"--config .*deep.yaml: nested too deep to read$"):
        load_config(path)


def test_yaml_merge_keys_still_load_and_an_override_of_a_merged_key_is_no_duplicate(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("run_name: x\nbase: &base {model: builtin:tiny-s, lr: 0.1}\nmembers:\n"
                    "- <<: *base\n  name: a\n  lr: 0.2\n")
    import yaml

    from ftis_engine.config import _UniqueKeyLoader

    raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    assert raw["members"][0] == {"model": "builtin:tiny-s", "lr": 0.2, "name": "a"}


def test_an_empty_text_override_is_the_empty_text_and_null_clears():
    assert load_config(TINY, ["data.system_prompt="]).data.system_prompt == ""
    assert load_config(TINY, ["data.system_prompt=null"]).data.system_prompt is None


def test_more_threads_than_cores_is_refused_where_the_run_runs_not_in_the_config():
    import os

    from ftis_engine.run.preflight import check_threads

    config = load_config(TINY, ["train.threads=100000"])  # a config made on a bigger machine stays valid
    assert config.train.threads == 100000
    cores = len(os.sched_getaffinity(0))
    check_threads(cores)
    with pytest.raises(ConfigError, match=rf"^train.threads: {cores + 1} threads for the {cores} core"):
        check_threads(cores + 1)


def test_every_shipped_run_config_loads():
    """configs/tiny.yaml, paper/, gpu/ and the open swarm's member configs (swarm/swarm.yaml is the coordinator's;
    study/ holds study specs, planned in test_study)."""
    paths = [TINY, *sorted((ROOT / "configs").glob("*/*.yaml"))]
    runs = [p for p in paths if p.parent.name not in ("study",) and p.name != "swarm.yaml"]
    assert len(runs) >= 20
    for path in runs:
        load_config(path)


def test_eval_reward_is_a_config_field_of_its_own_defaulting_to_the_tasks_check():
    assert load_config(TINY).eval.reward is None
    assert load_config(TINY, ["eval.reward=my_checks:right"]).eval.reward == "my_checks:right"
    with pytest.raises(ConfigError, match=r"^eval.reward: "):
        load_config(TINY, ["eval.reward="])


@pytest.mark.parametrize("overrides, held", [
    (["train.mini_batches=1000"], "a step's update holds 8 (rollout.prompts_per_step=8); at most 8"),
    (["train.mini_batches=9"], "a step's update holds 8 (rollout.prompts_per_step=8); at most 8"),
    (["train.mini_batches=5", "collaboration=alone"], "a step's update holds 4 (collaboration alone gives a member as "
                                                      "few as 4 of rollout.prompts_per_step=8 dealt to 2 members)"),
])
def test_more_mini_batches_than_a_steps_groups_is_refused_naming_the_field(overrides, held):
    """train.mini_batches=1000 with 8 groups a step: 8 optimizer steps a pass, without a word."""
    with pytest.raises(ConfigError, match=r"^train.mini_batches: \d+ optimizer steps a pass are cut from whole "
                                          rf"groups, and {re.escape(held)}"):
        load_config(TINY, overrides)
    assert load_config(TINY, ["train.mini_batches=8"]).train.mini_batches == 8
