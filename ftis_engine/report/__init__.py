"""What a run reports: `metrics` (metrics.jsonl and its one reader), `plots`, `progress` (the console line),
`trackers` (TensorBoard, W&B)."""
