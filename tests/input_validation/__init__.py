"""Input validation: bad input is refused with a clear error and changes
nothing (per-cache and batched calls, configurations, token shapes), and
hostile input (what clients did that once failed) stays bounded."""
