"""The sequence layer, one cache at a time: the worked scenarios of
docs/semantics.md §6, random conversations against the oracle, SWA scratch
slots and reuse statistics, stable pages, and the pages an engine reads and
copies."""
