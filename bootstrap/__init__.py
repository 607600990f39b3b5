"""The coordinator service (`hetnode bootstrap`): DHT bootstrap, run manifest, round sealing,
global model and checkpoints, contribution ledger, status page. Filled in by the swarm issues."""
