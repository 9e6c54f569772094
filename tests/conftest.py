"""Test-session setup: the ``backend`` fixture, every backend the suite runs
on (``tests/support/backends.py``, imported first: it chooses the CUDA
simulator before numba is imported)."""

from tests.support.backends import backend_params

import pytest  # noqa: I001 - after the backend choice


@pytest.fixture(params=backend_params())
def backend(request):
    return request.param
