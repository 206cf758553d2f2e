"""A small real trainer that steps through the job's SMB servers (for the liveness tests).

Each step every rank adds to a counter on every server and meets the others at an
SMB barrier, so a stopped or dead server holds every rank up in an SMB wait, as
a reduction would. ``--fail-all``: every rank raises the same error at step 2.
"""
import argparse
import time

import eddis.core as core

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--step-seconds", type=float, default=0.1)
p.add_argument("--fail-all", action="store_true")
args = p.parse_args()

core.init()
client = core.smb_client()
rank, size = core.rank(), core.size()
counters = [client.counter(f"test.steps.{s}", server=s) for s in range(client.num_servers)]
for step in range(args.steps):
    if args.fail_all and step == 2:
        raise RuntimeError(f"injected failure on every rank (rank {rank}) at step {step}")
    for counter in counters:
        counter.fetch_add(1)
    client.barrier(f"test.step.{step}", size).wait()
    print(f"step {step} servers {client.num_servers}", flush=True)
    time.sleep(args.step_seconds)
print("DONE")
