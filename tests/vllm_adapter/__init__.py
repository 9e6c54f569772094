"""gpukv as vLLM's KV cache manager (``gpukv.vllm``). The scripts that run
vLLM's own scheduler tests on it are in tests/vllm/."""
