"""The device tables: their memory (``index_memory``, ``max_blocks``,
``initial_blocks``), the change log's budget, and the cache pool a cache's
rows grow in."""
