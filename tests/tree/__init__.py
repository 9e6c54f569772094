"""The block radix tree: block keys (the hash chain, on the host and in
kernels), the tree operations on the device tables, reuse matching, registered
token sequences, and random tree operations against the oracle."""
