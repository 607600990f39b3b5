"""In-process experiments that run the coordinator's own code (`bootstrap/verifier.py`, the ledger's credit
rule) against the replicas' (`hetnode/daemon/`): `hetnode bench trust`, `bench trust --sybil`,
`bench chain-score`."""
