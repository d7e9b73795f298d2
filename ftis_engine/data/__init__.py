"""What members learn from and send: `tasks/` (datasets, prompts, Task.score), `rewards`, `rollouts` (Rollout and the
wire format, 8 bytes a token) and `context` (prompts and completions within every model's context)."""
