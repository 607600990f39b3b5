"""The service parts every long-running process shares — a peer daemon and the coordinator alike: data dir,
lifecycle and signals, the HTTP server, Prometheus metrics, the presence record and the round log."""
