"""What the tests share and that is not a test: the plain-Python oracles, the
test engine, the scenario rigs, the random conversation driver and the
lockstep runs built on it, the fault harness, the event checks and the
router the ZMQ tests run against."""
