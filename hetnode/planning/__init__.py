"""Pure decisions over a snapshot of the swarm (no I/O): layer splits, classes, roles, chain packing."""
