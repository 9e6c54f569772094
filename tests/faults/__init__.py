"""Faults: random calls failing at random points, interrupts at every line of
a call, and faults around a launch (a second thread, re-entrant callbacks,
an interrupted first kernel load); every outcome checked on real page data."""
