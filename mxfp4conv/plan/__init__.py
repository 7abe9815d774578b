"""Planning: SRC inspected, its units and shards planned into the job convert and verify start from."""
