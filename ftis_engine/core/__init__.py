"""What every layer shares and nothing of the engine's above it: `errors` (one-line messages), `threads` (a worker
thread whose failure reaches its owner), `safefile` (the one safe writer), `hub` (the HF hub's offline switch),
`limits` (bounds the config and the runtime share, without torch) and `dist` (a failed collective is PeerLost)."""
