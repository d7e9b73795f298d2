"""env.py, the one module that writes this process's environment: set_env holds its values for the block alone and
leaves the environment exactly as it found it (the oracle: a copy of os.environ taken before), whatever the block
did; set_for_process writes for good."""

from __future__ import annotations

import os

import pytest

from ftis_engine.core.env import set_env, set_for_process

SET, UNSET = "FTIS_TEST_ENV_SET", "FTIS_TEST_ENV_UNSET"


@pytest.fixture
def one_set_one_unset(monkeypatch):
    monkeypatch.setenv(SET, "before")
    monkeypatch.delenv(UNSET, raising=False)


def test_set_env_holds_its_values_in_the_block_and_puts_back_an_old_value_and_an_absence(one_set_one_unset):
    before = dict(os.environ)
    with set_env(**{SET: "during", UNSET: "during too"}):
        assert (os.environ[SET], os.environ[UNSET]) == ("during", "during too")
        assert dict(os.environ) == {**before, SET: "during", UNSET: "during too"}
    assert dict(os.environ) == before and UNSET not in os.environ


def test_set_env_puts_everything_back_when_the_block_raises(one_set_one_unset):
    before = dict(os.environ)
    with pytest.raises(KeyError, match="inside"):
        with set_env(**{SET: "during", UNSET: "during"}):
            raise KeyError("inside")
    assert dict(os.environ) == before


def test_set_env_puts_back_what_the_block_changed_of_its_own_variables_and_leaves_the_rest(one_set_one_unset,
                                                                                          monkeypatch):
    """A library that rewrites a variable set_env holds (vLLM sets VLLM_ENABLE_V1_MULTIPROCESSING itself) gets it put
    back too; a variable set_env does not hold is the block's own business."""
    other = "FTIS_TEST_ENV_OTHER"
    monkeypatch.delenv(other, raising=False)
    before = dict(os.environ)
    with set_env(**{SET: "during", UNSET: "during"}):
        os.environ[SET] = "rewritten"
        del os.environ[UNSET]
        os.environ[other] = "written in the block"
    assert dict(os.environ) == {**before, other: "written in the block"}


def test_set_env_nested_on_one_variable_unwinds_to_each_level(one_set_one_unset):
    with set_env(**{SET: "outer"}):
        with set_env(**{SET: "inner"}):
            assert os.environ[SET] == "inner"
        assert os.environ[SET] == "outer"
    assert os.environ[SET] == "before"


def test_set_env_with_a_value_that_is_not_text_raises_and_writes_nothing(one_set_one_unset):
    before = dict(os.environ)
    with pytest.raises(TypeError):
        with set_env(**{UNSET: "text", SET: 1}):
            raise AssertionError("the block never runs")
    assert dict(os.environ) == before


def test_set_for_process_writes_for_good(one_set_one_unset):
    before = dict(os.environ)
    set_for_process(**{UNSET: "for good"})
    assert dict(os.environ) == {**before, UNSET: "for good"}  # (the fixture's monkeypatch unsets it after the test)
