"""Messages on the wire: msgpack framing, validation against the run's limits, record schemas."""
