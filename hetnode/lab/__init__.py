"""Tools that measure or stage a swarm; not run by a volunteer or a coordinator."""
