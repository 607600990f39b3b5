"""Pure math for hetnode (docs/sync.md and docs/chains.md): SparseLoCo codec, aggregation, outer steps,
optimisers.

This layer imports only torch, numpy and the standard library, so it is unit-tested without sockets and
gives the same numbers on every replica. Import the submodules directly (`hetnode.algo.sparseloco`, ...).
"""
