"""hetnode: heterogeneous decentralised pre-training (anchors + compressed chains + SparseLoCo)."""

__version__ = "0.1.0"
