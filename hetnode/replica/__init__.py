"""θ as every replica holds it and the round math on it, below the daemon, the coordinator and bench."""
