"""KV cache events: the event manager on synthetic change logs, the
translation of change logs, events from the kernels of a real manager, scopes
and clears, the ZMQ publisher in vLLM's wire format, and a real router
(Dynamo's indexer) fed by gpukv workers."""
