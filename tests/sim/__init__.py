"""``gpukv simulate``: the scheduler loop and its policies, and the workloads
(the Mooncake trace loader and the synthetic conversations)."""
