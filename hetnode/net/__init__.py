"""The only layer that imports hivemind: identity, signed DHT records, P2P handlers, probes."""
