"""The plain-Python oracles (tests/support/oracle.py, oracle_kv.py) tested on their
own, against the worked examples of docs/semantics.md and random workloads."""
