"""The coordinator service (`hetnode bootstrap`): the DHT's stable entry point, the run manifest and the
boundary clock. Round sealing, the global model, checkpoints, the ledger and the status page come next."""
