"""The notebook-kernel fixtures (``broker``, ``on_broker``, ``gpu_broker``,
``on_gpu_broker``, ``extra_broker``, ``kernels``, ``fake_driver``) for the tests of this
folder; they live in ``tests/notebook_fixtures.py``."""

from notebook_fixtures import *  # noqa: F403 - the fixtures must be names of this module
