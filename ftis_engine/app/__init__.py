"""The command line and how a process ends: `cli` (train, eval, plot, study, models, swarm serve), `entry` (the
console script), `launch` (several processes: --nproc, torchrun, the elastic agent) and `exits` (the one table from
what a command raised to its exit code and one line). The top of the package: nothing below imports it."""
