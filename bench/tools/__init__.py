"""Tools around the benchmarks that are not benchmarks: the report, the profilers, the one-off scripts."""
