"""In-process simulations: several replicas (and later pipeline stages) with the transport swapped out."""
