"""The local training loop: the inner steps every replica runs (anchors, chains, `hetnode train`)."""
