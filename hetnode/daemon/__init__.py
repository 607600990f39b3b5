"""Daemon lifecycle: the peer (`hetnode join`), its presence in the DHT, roles and chain assembly."""
