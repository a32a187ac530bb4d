"""One error base per layer: every exception class gpushare defines derives from its
layer's base (all from ``GpushareError``) and carries a code and a one-line message."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import gpushare_ext
from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.errors import GpushareError
from gpushare_ext.kernels import KernelError
from gpushare_ext.runtime.errors import SessionError

LAYER_BASES = {"broker": DaemonError, "runtime": SessionError, "kernels": KernelError}
SKIP = {"gpushare_ext.server_ext.handlers", "gpushare_ext.widgets"}  # need Jupyter pieces


def defined_errors() -> list[tuple[str, type]]:
    found = []
    for info in pkgutil.walk_packages(gpushare_ext.__path__, "gpushare_ext."):
        if info.name in SKIP or info.name.startswith("gpushare_ext.labextension"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue  # an optional dependency (Jupyter server, the GPU stack) is missing
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                found.append((info.name, cls))
    return found


def test_every_error_has_its_layer_s_base():
    errors = defined_errors()
    assert len(errors) >= 20, [c.__name__ for _, c in errors]
    wrong = []
    for module, cls in errors:
        layer = module.split(".")[1]
        base = LAYER_BASES.get(layer, GpushareError)
        if not issubclass(cls, base) and cls is not base:
            wrong.append(f"{module}.{cls.__name__} is not a {base.__name__}")
    assert not wrong, "\n".join(wrong)


def test_an_error_has_a_code_and_the_message_it_was_given():
    from gpushare_ext.runtime.session import LeaseTimeout

    error = LeaseTimeout("no grant within 30 s")
    assert (error.code, error.message, str(error)) == (
        "session",
        "no grant within 30 s",
        "no grant within 30 s",
    )
    assert isinstance(error, TimeoutError)  # callers that catch the built-in still do
    kernel = KernelError("bad-ptx", "no entry", step="parse")
    assert (kernel.code, kernel.message) == ("bad-ptx", "no entry")
