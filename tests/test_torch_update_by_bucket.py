"""When ``DistributedOptimizer.step()`` updates bucket by bucket (EDDIS_OVERLAP_OPTIMIZER), and
when it must not: the wrapped optimizer's own step() calls are counted on 1 and 2 ranks.

- torch.optim's SGD: one call per bucket on 2 ranks (auto), one on 1 rank (nothing to wait for);
- a subclass of SGD (its update may read every parameter): one call under auto, one per bucket
  under ``on``;
- a step hook on the optimizer, a closure, or skip_synchronize(): one call, whatever the setting;
- the parameter agreement check still sees every parameter of an optimizer while it updates a
  bucket, and the parameters end the same as with one update (the same math).

This file is also the worker: ``mpirun -n N python tests/test_torch_update_by_bucket.py``.
"""
import json
import os
import sys

STEPS = 3


def worker():
    import torch
    import torch.nn.functional as F

    import eddis.torch as eddis
    from eddis.core.progress import agreement
    from eddis.torch import agreement as torch_agreement

    eddis.init()
    rank, size = eddis.rank(), eddis.size()

    class MySGD(torch.optim.SGD):
        pass

    def run(case, overlap):
        os.environ["EDDIS_OVERLAP_OPTIMIZER"] = overlap
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                    torch.nn.Tanh(), torch.nn.Linear(32, 4))
        cls = MySGD if case == "subclass" else torch.optim.SGD
        optimizer = eddis.DistributedOptimizer(cls(model.parameters(), lr=0.1, momentum=0.9),
                                               named_parameters=model.named_parameters(), bucket_bytes=2048)
        calls, seen_by_check = [], []
        inner_step = cls.step

        def counted(self, *args, **kwargs):
            if self is optimizer:
                calls.append(sum(len(g["params"]) for g in self.param_groups))
                # what the agreement check's step hook notes of the optimizer, mid-update
                seen_by_check.append(len(torch_agreement._params(self)))
            return inner_step(self, *args, **kwargs)

        cls.step = counted
        hook = optimizer.register_step_post_hook(lambda *a: None) if case == "hook" else None
        try:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step * 10 + rank)
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

                def loss():
                    return F.cross_entropy(model(x), y)

                optimizer.zero_grad()
                loss().backward()
                if case == "closure":
                    optimizer.step(loss)
                elif case == "skip":
                    optimizer.synchronize()
                    with optimizer.skip_synchronize():
                        optimizer.step()
                else:
                    optimizer.step()
        finally:
            cls.step = inner_step
            if hook is not None:
                hook.remove()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result = {"case": case, "overlap": overlap, "buckets": len(optimizer.reducer.plan.buckets),
                  "calls_per_step": len(calls) / STEPS, "params_per_step": sum(calls) / STEPS,
                  "params": sum(1 for _ in model.parameters()), "checked": min(seen_by_check),
                  "flat": flat.tolist()}
        optimizer.close()
        return result

    cases = [("plain", "auto"), ("plain", "off"), ("subclass", "auto"), ("subclass", "on"),
             ("hook", "on"), ("closure", "on"), ("skip", "on")]
    results = [run(case, overlap) for case, overlap in cases]
    agreement.check("the test's end")   # the optimizers updated by bucket agree on every rank
    if rank == 0:
        print("RESULTS " + json.dumps({"size": size, "results": results}), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_update_runs_by_bucket_only_where_it_is_the_same_math(run_mpi, ranks):
    proc = run_mpi(ranks, [PYTHON, __file__], timeout=200, check=True)
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    found = json.loads(line[len("RESULTS "):])
    assert found["size"] == ranks
    by_case = {(r["case"], r["overlap"]): r for r in found["results"]}
    buckets = by_case[("plain", "auto")]["buckets"]
    assert buckets > 1, "the test model must span several buckets"
    by_bucket = {("plain", "auto"), ("subclass", "on")} if ranks > 1 else set()
    for key, r in by_case.items():
        assert r["calls_per_step"] == (buckets if key in by_bucket else 1), r
        assert r["params_per_step"] == r["params"], r     # every parameter updated once a step
        assert r["checked"] == r["params"], r             # the check sees every one meanwhile
    # the same math either way: one update, or one per bucket
    assert by_case[("plain", "auto")]["flat"] == by_case[("plain", "off")]["flat"]
    assert by_case[("subclass", "on")]["flat"] == by_case[("plain", "off")]["flat"]
