"""`ftis-engine study`: a grid of train runs (method x collaboration x g x member set x seed), each its own process,
resumable, then aggregated over seeds into summary.json, report.md and figures.

A study config (configs/study/paper.yaml) names a `base` run config, `member_sets`, `seeds` and `groups`; a group
is a member set, a collaboration and dotted overrides, optionally a `grid` of overrides whose product makes one
group per combination. Layout of the output directory:

    runs/<group>/seed-<s>/   a run directory (train's own)     configs/<group>/seed-<s>.yaml   its config
    logs/<group>-seed-<s>.log its output                       configs/<group>/seed-<s>.code.jsonl  its code
    summary.json, report.md, figures/*.png                     (the commit and start of each launch)
    verdicts.md              the pre-registered hypotheses     records/<group>/seed-<s>.metrics.jsonl.gz  a
                             judged (a study with them)        finished run's records, kept to commit

A run is finished when its final_eval.json exists; finished runs are skipped, an interrupted one resumes from its
newest checkpoint (or starts again when it has none). A finished run whose config differs from the study's is an
error, never silently reused; one made under another commit is reused with a warning, and the summary and report
name it. A study whose config carries a pre-registration (`preregistration`: hypotheses, each with the tests it
is judged on) refuses to start while the files that hold it have changes git has not committed, and judges them
under Holm's correction (verdicts.md); `--aggregate-only` recomputes every output from records/ without running.

The package, by concern: config.py (the schema), plan.py (the runs and their configs), runner.py (the processes),
aggregate.py (the statistics), verdicts.py (the hypotheses judged; verdicts.md written again from summaries),
report.py (summary.json, report.md, verdicts.md), tables.py (report.md's tables and their cells), figures.py
(the figures), rewrite.py (a finished study's report written again from its summary.json).
"""

from __future__ import annotations

from .aggregate import add_paired_differences, aggregate, interval, paired_difference, read_run
from .config import FigureSettings, GroupSettings, QuickSettings, StudyConfig, StudyError, load_study
from .figures import draw_figures
from .plan import Group, Run, check_reuse, expand_groups, plan
from .report import report_markdown, write_outputs
from .runner import Launcher, run_study

__all__ = ["FigureSettings", "Group", "GroupSettings", "QuickSettings", "Run", "StudyConfig", "StudyError",
           "add_paired_differences", "aggregate", "check_reuse", "draw_figures", "expand_groups", "interval",
           "Launcher", "load_study", "paired_difference", "plan", "read_run", "report_markdown", "run_study",
           "write_outputs"]
