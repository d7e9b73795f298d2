"""A run of the engine in one process: `trainer` (build(config, start, connection) -> Trainer; run()), `session`
(open_run: the members, the schedule, the receivers), `wiring` (this process's transport, role and shard), `restore`,
`preflight`, `rundir`, `loop` (the step loop: train), `step` (one step in the paper's verbs), `sampling` (a member's
rollouts of a step), `samplers` (a sampler rank's loop) and `evaluate`."""
