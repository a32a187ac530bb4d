#!/usr/bin/env bash
# Prepares a bare GPU machine for the GPU tests and benchmarks of this checkout.
#
#   source benchmarks/device_setup.sh [WHEELS]
#
# WHEELS (default .whl) holds the wheels the machine's image lacks (ipykernel, nbclient,
# msgspec, py-spy ...) and, in WHEELS/np, a numpy below 2.5 for Numba (numba-cuda cannot
# compile under numpy 2.5).  They are installed under /tmp/site and /tmp/np, which go on
# PYTHONPATH (numpy 2.4 first), with this checkout; the launch shim is compiled in place
# with the same command as the package's build hook (hatch_build.py).
wheels=${1:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || return 1
if compgen -G "$wheels/np/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np "$wheels"/np/*.whl || return 1
fi
${CC:-cc} -O2 -Wall -Wextra -shared -fPIC -o gpushare_ext/runtime/native/libgpushare_interpose.so \
  gpushare_ext/runtime/native/launch_interpose.c gpushare_ext/runtime/native/parkable_memory.c \
  -ldl -lpthread || return 1
export PATH=/tmp/site/bin:$PATH
export PYTHONPATH=/tmp/np:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,mig.mode.current --format=csv,noheader
