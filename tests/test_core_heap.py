"""EDDIS_KEEP_FREED_MEMORY: after eddis.init(), a gradient allocated anew each step (PyTorch
after zero_grad(), which sets .grad to None) reuses pages the last step faulted in, instead of
a fresh mmap the kernel zeroes page by page; with the setting at 0 glibc's own policy stays.
Counted in the process's minor page faults, not timed.

This file is also the worker: ``mpirun -n N python tests/test_core_heap.py`` prints each
rank's faults per step.
"""
import os
import sys

GRADIENT_SIDE = 4096   # a 4096 x 4096 fp32 weight: a 64 MiB gradient, above glibc's mmap threshold
STEPS = 20
PAGES = GRADIENT_SIDE * GRADIENT_SIDE * 4 // 4096


def train():
    import resource

    import torch
    import eddis.torch as eddis

    eddis.init()
    torch.set_num_threads(1)
    layer = torch.nn.Linear(GRADIENT_SIDE, GRADIENT_SIDE, bias=False)
    x = torch.randn(2, GRADIENT_SIDE)
    faults = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(f"FAULTS {eddis.rank()} {' '.join(map(str, faults))}", flush=True)


if __name__ == "__main__":
    train()
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

HERE = os.path.abspath(__file__)


def _faults_per_step(run_mpi, ranks, keep):
    env = {} if keep is None else {"EDDIS_KEEP_FREED_MEMORY": keep}
    proc = run_mpi(ranks, [PYTHON, HERE], env=env, timeout=120, check=True)
    lines = [line.split()[2:] for line in proc.stdout.splitlines() if line.startswith("FAULTS ")]
    assert len(lines) == ranks, proc.stdout
    return [[int(f) for f in line] for line in lines]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_gradient_allocated_anew_reuses_the_last_steps_pages(run_mpi, ranks):
    for steps in _faults_per_step(run_mpi, ranks, None):   # the default: on
        # once the heap holds the gradients' worth (a few steps in), a freed gradient's pages
        # serve the next one; the heap's layout can still make a step map one anew now and
        # then (seen: at most 3 of these 16 steps), where glibc's default does every step
        refaulted = [f for f in steps[4:] if f > PAGES // 4]
        assert len(refaulted) <= len(steps[4:]) // 3, (steps, PAGES)


@pytest.mark.timeout(150)
def test_zero_leaves_the_c_heaps_policy_as_it_is(run_mpi):
    for steps in _faults_per_step(run_mpi, 1, "0"):
        # glibc maps a 64 MiB block anew at each allocation: every page faults again
        assert min(steps[4:]) >= PAGES * 9 // 10, (steps, PAGES)
