"""A run of the engine in one process: `trainer` (run(config, start, connection): the one start-up; the role's
Trainer, Learner / Sampler / Evaluator, the one place generators close), `session` (open_run: the members, the
schedule, the receivers), `wiring` (this process's transport, role and shard), `restore`, `preflight`, `rundir`,
`loop` (a learner's step loop: train), `records` (where a learner's records go, by role), `step` (one step in the
paper's verbs), `sampling` (a member's rollouts of a step), `samplers` (a sampler rank's loop) and `evaluate`."""
