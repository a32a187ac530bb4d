"""The real-GPU broker fixture (``gpu_broker``) for the GPU tests of this folder; it lives
in ``tests/notebook_fixtures.py`` with the other notebook-kernel fixtures."""

from notebook_fixtures import gpu_broker  # noqa: F401 - the fixture must be a name here
