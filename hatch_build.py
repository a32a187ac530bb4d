"""Build hook: compiles the native launch interposer with the system's C compiler.

The C sources in ``gpushare_ext/runtime/native/`` (the launch shim and its parkable
memory) need no CUDA or CUPTI headers, so any machine with ``cc`` (or ``$CC``) builds
them, GPU or not.  The shared library lands
beside the source (for editable installs) and in the wheel.  Without a compiler the
install goes on and says so: sessions are then paused by the checkpoint lock alone,
and the runtime names the reason in the cell.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NATIVE = Path("gpushare_ext/runtime/native")
SOURCES = (NATIVE / "launch_interpose.c", NATIVE / "parkable_memory.c")
LIBRARY = Path("gpushare_ext/runtime/native/libgpushare_interpose.so")


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        compiler = shlex.split(os.environ.get("CC", "cc"))
        if shutil.which(compiler[0]) is None:
            print(
                f"gpushare: no C compiler ({compiler[0]}): the launch interposer is not built",
                file=sys.stderr,
            )
            return
        command = [
            *compiler, "-O2", "-Wall", "-Wextra", "-shared", "-fPIC",
            "-o", str(root / LIBRARY), *(str(root / source) for source in SOURCES), "-ldl", "-lpthread",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(
                "gpushare: the launch interposer did not compile:\n" + result.stderr,
                file=sys.stderr,
            )
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].append(str(LIBRARY))
