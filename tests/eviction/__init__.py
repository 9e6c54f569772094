"""Eviction under memory pressure: the order of victims (recency, priorities),
what a page death takes, the eviction lists, the pages an allocation can get,
and the host tier (pages that migrate to host memory and come back)."""
