"""Timeline + profile overhead: step time with both on vs both off (printed, not asserted).

Two measurements:

1. Cost of one timeline call on the training thread (off: the no-op fast path;
   on: the append to the buffer), in nanoseconds.
2. A training loop of a small torch CNN (the shape of examples/ training), with
   the instrumentation the runtime emits per step: bucket-ready, compress, push,
   pull per gradient bucket, wait, optimizer step, the step itself, and one
   profile row. Blocks of ``--block`` steps alternate off/on in one run, so load
   changes of a shared machine hit both alike; the median step times give the
   overhead.

    python bench/timeline_overhead.py [--steps 400] [--block 10] [--buckets 8]
        [--device cuda] [--model resnet18] [--batch 256]
    python bench/timeline_overhead.py --example 2 [--rounds 3] [--epochs 3]

3. ``--example RANKS``: the PyTorch example end to end under mpirun (mode sync),
   runs alternately off and on; the median samples/s of each give the overhead.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from eddis import timeline as tl  # noqa: E402


def per_call_ns(n=200_000):
    def loop():
        t0 = time.perf_counter_ns()
        for i in range(n):
            with tl.span(tl.PUSH, args=None):
                pass
            tl.instant(tl.BUCKET_READY)
        return (time.perf_counter_ns() - t0) / (2 * n)

    base = time.perf_counter_ns()
    for i in range(n):
        with_nothing = None  # noqa: F841  (the bare loop, to subtract)
    empty = (time.perf_counter_ns() - base) / (2 * n)
    off = loop() - empty
    with tempfile.TemporaryDirectory() as d:
        tl.start_timeline(d, rank=0)
        tl.active().capacity = 4 * n
        on = loop() - empty
        tl.stop_timeline()
    return off, on


def make_model(name="cnn"):
    import torch

    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def run_blocks(steps, block, buckets, directory, device="cpu", model_name="cnn", batch=64):
    """Alternate blocks of ``block`` steps with instrumentation off and on; same model, same data."""
    import torch

    from eddis.timeline.profile import StepProfiler

    model = make_model(model_name).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prof = StepProfiler(Path(directory) / "run", 0, mode="bench")
    times = {False: [], True: []}
    for step in range(steps):
        on = (step // block) % 2 == 1
        if step % block == 0:
            if on:
                tl.start_timeline(Path(directory) / "timeline", rank=0)
            else:
                tl.stop_timeline()
        t0 = time.perf_counter()
        start = tl.now_ns()
        with tl.span(tl.FORWARD, args={"step": step}):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        with tl.span(tl.BACKWARD, args={"step": step}):
            loss.backward()
        for b in range(buckets):
            nbytes = 4096 * (b + 1)
            tl.instant(tl.BUCKET_READY, args={"step": step, "bucket": b, "bytes": nbytes})
            with tl.span(tl.COMPRESS, args={"step": step, "bucket": b, "bytes": nbytes}):
                pass
            with tl.span(tl.PUSH, args={"step": step, "bucket": b, "bytes": nbytes}):
                pass
            t = tl.now_ns()
            tl.complete(tl.PULL, t, args={"step": step, "bucket": b, "bytes": nbytes})
            if on:
                prof.add_comm(1e-6, nbytes, nbytes)
        with tl.span(tl.WAIT, args={"step": step}):
            if on:
                prof.add_wait(0.0)
        with tl.span(tl.OPTIMIZER_STEP, args={"step": step}):
            opt.step()
        sync()  # a GPU step is done when its kernels are
        tl.complete(tl.STEP, start, args={"step": step})
        if on:
            prof.step_end(batch)
        elapsed = time.perf_counter() - t0
        if step % block >= 2:  # the first steps of a block pay for the switch
            times[on].append(elapsed)
    tl.stop_timeline()
    prof.close()
    return times[False], times[True]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--block", type=int, default=10, help="steps per off/on block")
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default="cnn", choices=["cnn", "resnet18"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--example", type=int, default=0, metavar="RANKS",
                        help="instead: run examples/torch_train.py on RANKS MPI ranks (mode sync, embedded "
                             "server), alternately without and with EDDIS_TIMELINE + EDDIS_PROFILE, and "
                             "compare the samples/s it prints")
    parser.add_argument("--rounds", type=int, default=3, help="with --example: off/on pairs")
    parser.add_argument("--epochs", type=int, default=3, help="with --example: epochs per run")
    args = parser.parse_args(argv)
    if args.example:
        return example_runs(args)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    off_ns, on_ns = per_call_ns()
    print(f"per call on the training thread: off {off_ns:.0f} ns, on {on_ns:.0f} ns")
    with tempfile.TemporaryDirectory() as d:
        run_blocks(20, 10, args.buckets, d, args.device, args.model, args.batch)  # warm-up (lazy init)
        off_steps, on_steps = run_blocks(args.steps, args.block, args.buckets, d, args.device, args.model,
                                         args.batch)
    off, on = statistics.median(off_steps), statistics.median(on_steps)
    events = 4 * args.buckets + 5
    print(f"{args.model} on {args.device}, batch {args.batch}")
    print(f"step time (median of {len(off_steps)} steps): off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms "
          f"({events} timeline events + 1 profile row per step)")
    print(f"overhead: {100.0 * (on - off) / off:+.2f}% of step time "
          f"(expected from the per-call cost: {100.0 * events * (on_ns - off_ns) * 1e-9 / off:.2f}%)")


def example_runs(args):
    """The example end to end under mpirun, instrumentation off vs on, alternating."""
    import os
    import re
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    rates = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for on in (False, True):
                env = dict(os.environ, PYTHONPATH=str(repo / "src"), OMP_NUM_THREADS="1",
                           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                           EDDIS_RUN_DIR=str(Path(d) / f"run{r}{int(on)}"))
                env.pop("EDDIS_TIMELINE", None)
                env["EDDIS_PROFILE"] = "1" if on else "0"
                if on:
                    env["EDDIS_TIMELINE"] = str(Path(d) / f"tl{r}")
                cmd = ["mpirun", "--oversubscribe", "-n", str(args.example),
                       sys.executable, str(repo / "examples" / "torch_train.py"),
                       "--epochs", str(args.epochs), "--mode", "sync"]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                found = re.search(r"mode \S+\s+(\d+) samples/s", proc.stdout)
                if proc.returncode != 0 or not found:
                    print(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                    return 1
                rates[on].append(float(found.group(1)))
                print(f"round {r} {'on ' if on else 'off'}: {rates[on][-1]:.0f} samples/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"examples/torch_train.py, {args.example} ranks, mode sync: median off {off:.0f} samples/s, "
          f"on {on:.0f} samples/s: overhead {100.0 * (off - on) / off:+.2f}% of step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
