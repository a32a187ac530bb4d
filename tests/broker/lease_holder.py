"""A stand-in for a notebook kernel: takes one lease, says so on stdout, holds it until killed.

Used by the dead-client and crash-recovery tests, which need a lease owned by a process
they can kill.  Prints one JSON line: the first answer (granted/queued) and its lease id.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Capabilities, Granted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--priority", type=int, default=150)
    parser.add_argument("--memory-gib", type=float, default=8)
    parser.add_argument("--instrumented", action="store_true", help="gate + yield flag")
    args = parser.parse_args()
    client = BrokerClient(args.socket, notebook="holder.ipynb")
    capabilities = (
        Capabilities(instrumented_only=True, gate=True, yield_flag=True)
        if args.instrumented
        else Capabilities()
    )
    reply = client.request_lease(
        priority=args.priority,
        memory_bytes=int(args.memory_gib * 1024**3),
        capabilities=capabilities,
        label="holder",
    )
    print(
        json.dumps(
            {
                "answer": type(reply).__name__,
                "lease_id": reply.lease_id,
                "granted": isinstance(reply, Granted),
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    while not client.closed.is_set():
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
