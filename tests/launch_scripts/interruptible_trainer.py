"""A trainer that handles Ctrl-C itself, for the launcher's interrupt tests.

Steps until it is interrupted (at most ``--seconds``); its ``except KeyboardInterrupt``
meets the other ranks in a barrier (the runtime still works there), writes
``<marker dir>/interrupted.<rank>`` and exits 0, as a script that saves on Ctrl-C
would. ``--ignore-sigint``: it never sees the interrupt, so the launcher must go on to
SIGTERM.
"""
import argparse
import signal
import sys
import time
from pathlib import Path

from eddis.core.basics import basics as eddis

p = argparse.ArgumentParser()
p.add_argument("marker_dir")
p.add_argument("--seconds", type=float, default=120.0)
p.add_argument("--ignore-sigint", action="store_true")
args = p.parse_args()

if args.ignore_sigint:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
eddis.init()
rank = eddis.rank()
step = 0
deadline = time.monotonic() + args.seconds
try:
    while time.monotonic() < deadline:
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.1)
    print("never interrupted", flush=True)
    sys.exit(1)
except KeyboardInterrupt:
    print(f"rank {rank}: caught KeyboardInterrupt at step {step}, saving", flush=True)
    eddis.barrier()
    Path(args.marker_dir, f"interrupted.{rank}").write_text(str(step))
    print(f"rank {rank}: saved", flush=True)
