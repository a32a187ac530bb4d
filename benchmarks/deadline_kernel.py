"""A real ipykernel kernel whose cells have deadlines, for benchmarks that run other
people's code in notebook cells (``unmarked.py``, ``peer_suites.py``).

A cell that outlives its deadline is reported as ``"timeout"`` rather than waited for;
:meth:`DeadlineKernel.stack` then shows where the kernel waits (``py-spy``, when it is
installed).  The kernel is killed when this process exits, whatever ends it, so no run
leaves one behind.  It must not interpret what the cells print: callers do.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path


class DeadlineKernel:
    """A kernel started with ``env`` (its environment decides the launch shim and socket)."""

    def __init__(self, env: dict[str, str]) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env)
        _, text = self.run("import os; print(os.getpid())", 120)
        self.pid = int(text.strip().splitlines()[-1])
        atexit.register(self.kill)  # a run ended by a signal leaves no kernel behind

    def run(self, code: str, timeout: float) -> tuple[str, str]:
        """(status, printed text and tracebacks); status "timeout" past the deadline."""
        printed: list[str] = []

        def collect(message: dict) -> None:
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                printed.append("\n".join(message["content"].get("traceback", [])))

        try:
            reply = self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        except TimeoutError:
            return "timeout", "".join(printed)
        return reply["content"]["status"], "".join(printed)

    def stack(self) -> str:
        """Where the kernel's threads wait now, Python and native frames."""
        spy = shutil.which("py-spy")
        if spy is None:
            return "(py-spy not installed)"
        done = subprocess.run(
            [spy, "dump", "--native", "--pid", str(self.pid)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return done.stdout + done.stderr

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        try:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=True)
        except Exception:  # a hung kernel: it goes anyway
            self.kill()


def kernel_environment(
    *,
    shim: bool,
    socket: Path | None,
    package_root: Path | None = None,
    cache_prefix: str = "gpushare-cupy-",
) -> dict[str, str]:
    """This process's environment for a kernel started as the gpushare server extension
    starts kernels (``shim``: the launch shim preloaded, CuPy compiling to PTX) or as a
    plain Jupyter server does, with its own CuPy cache and, given ``socket``, that broker.
    ``package_root``: the copy of gpushare the kernel imports (first on its path)."""
    root = package_root or Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.pop("LD_PRELOAD", None)
    env["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix=cache_prefix)
    if shim:
        from gpushare_ext.runtime import frameworks

        env["LD_PRELOAD"] = str(root / "gpushare_ext/runtime/native/libgpushare_interpose.so")
        frameworks.kernel_environment(env)  # what the server extension sets, where unset
    if socket is not None:
        env["GPUSHARE_SOCKET"] = str(socket)
    return env
