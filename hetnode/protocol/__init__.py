"""The swarm protocol the coordinator and the peers share: the view of the swarm and its change log,
membership, sealing, how sync payloads are opened, how θ is fetched from a holder, the signed status document.
Below both `hetnode/daemon/` (a peer) and `bootstrap/` (the coordinator): neither's internals are here."""
