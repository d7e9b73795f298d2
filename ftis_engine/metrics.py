"""metrics.jsonl (one JSON object a line) and TensorBoard events, written as the run goes."""

from __future__ import annotations

import json
import math
import os
import pathlib


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends lines to run_dir/metrics.jsonl (flushed and fsynced per line) and mirrors numbers to TensorBoard
    under run_dir/tensorboard as `<member>/<kind>/<key>`."""

    def __init__(self, run_dir: pathlib.Path, purge_step: int | None = None, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, record: dict) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            prefix = f"{record['member']}/{record['kind']}"
            if record["kind"] == "eval":
                prefix += f"/{record['dataset']}"
            for key, value in record.items():
                if key not in ("step", "member", "kind", "dataset") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a crash ends the readable log
    return lines


def truncate_metrics(path: pathlib.Path, last_step: int) -> None:
    """Keep only the records of steps <= last_step (the resumed run rewrites what came after), atomically."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
