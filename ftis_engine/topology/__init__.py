"""Pure functions of the config: `layout` (which process is which member's shard or sampler, a process's Role) and
`schedule` (deals, seeds, parcel sizes, policy versions, staleness)."""
