"""Small configs and members for the trainer tests."""

from __future__ import annotations

import pathlib
import sys

import torch

from ftis_engine.config import load_config
from ftis_engine.member.members import build_member
from ftis_engine.report.metrics import read_metrics
from ftis_engine.run.preflight import check_members
from ftis_engine.model.batch import TrainItem
from ftis_engine.data.rollouts import Rollout

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ci_commands(root: pathlib.Path = ROOT) -> list[str]:
    """The lines of .ci/run, stripped, each command without the `|| fail "..."` that stops CI at its failure."""
    import re

    return [re.sub(r' \|\| fail "[^"]*"$', "", line.strip()) for line in (root / ".ci" / "run").read_text().splitlines()]
TINY = ROOT / "configs" / "tiny.yaml"

# A shortened tiny default: a few steps, small groups, eval and checkpoints every 2 steps.
SHORT = [
    "train.steps=4", "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=3",
    "eval.every=2", "eval.max_samples=16", "checkpoint.every=2", "checkpoint.keep_last=3", "train.threads=1",
]


def short_config(*overrides: str, **kwargs):
    return load_config(TINY, [*SHORT, *overrides])


def member(index: int = 0, *overrides: str):
    cfg = short_config(*overrides)
    tokenizers = check_members(cfg)
    return build_member(index, cfg, tokenizers[index], torch.device("cpu")), cfg


def run_records(run_dir: pathlib.Path, kind: str | None = None, *, live: bool = False) -> list[dict]:
    """The records of run_dir/metrics.jsonl (of one kind), in order, through metrics.read_metrics. Read strictly: the
    file is there and every complete line is a record. live: a run still writing (an open-swarm member's job), where
    a missing file or a bad line fails nothing. Either way the line a writer is in the middle of is left out."""
    return read_metrics(run_dir / "metrics.jsonl", kinds=kind, strict=not live)


def as_rank_1_of_a_world(monkeypatch):
    """This process as rank 1 of an initialised torch world: where a member's leader is under --nproc when it is
    member 1 (transformers reads these two functions to decide whether a rank writes)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)


def random_items(vocab: int, n_groups: int = 3, per_group: int = 4, seed: int = 0) -> list[TrainItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for group in range(n_groups):
        for _ in range(per_group):
            length = int(torch.randint(1, 6, (1,), generator=g))
            prompt = torch.randint(4, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            rollout = Rollout(member=0, prompt_index=group, completion_ids=torch.randint(4, vocab, (length,), generator=g,
                                                                                         dtype=torch.int32),
                              gen_logprobs=-torch.rand(length, generator=g) * 6, reward=float(torch.rand(1, generator=g) > 0.5),
                              finish_reason="length", policy_version=0)
            items.append(TrainItem(rollout, prompt, float(torch.randn(1, generator=g)), group))
    return items


def with_default_sigint(argv: list[str]) -> list[str]:
    """A command line that runs `argv` with SIGINT at its default (Python's KeyboardInterrupt), whatever this
    process inherited: a background job of a non-interactive shell (a CI script's `cmd &`) starts with SIGINT
    ignored, and Python then installs no handler, so a test's SIGINT would do nothing."""
    launcher = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", launcher, *argv]


def command_here(capsys, *args):
    """`ftis-engine ARGS` run in this process: cli.main, the command's own handling of errors and exit codes, without
    a new interpreter's 2-3 s of imports (a refusal test needs nothing else; what needs a process of its own, a
    signal or a traceback on the real stderr, spawns one). Returns a subprocess.CompletedProcess (returncode,
    stdout, stderr), as a test written against the command expects."""
    import signal
    import subprocess

    from ftis_engine.app import cli

    argv = [str(a) for a in args]
    capsys.readouterr()
    terminate = signal.getsignal(signal.SIGTERM)  # cli.main installs its SIGTERM handler: this process keeps its own
    code: object = 0
    try:
        cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, terminate)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code if isinstance(code, int) else 0 if code is None else 1, out, err)
