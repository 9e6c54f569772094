"""gpukv's tests: a package, so that every test module imports the shared
support code the same way (``from tests.support.oracle import ...``) and
test files in different folders may share a name."""
