"""Uneven batches per rank, then join(): run by tests/test_join.py under eddis-train --local.

Two epochs of a linear least-squares model with momentum SGD. In epoch 0 rank r takes
3 + r steps, in epoch 1 2 + (size - 1 - r), each on its own batch of 4 + r samples
(seeded by epoch, rank and step, so the test can recompute every one), with the
sample count as its weight; then every rank calls join(). Prints one JOIN-RESULT line:
the ranks join() named last in each epoch and the final parameters (fp32).

    join_trainer.py --framework torch|tensorflow [--mode sync|allreduce|easgd] [--set NAME=VALUE ...]
    join_trainer.py --framework torch|tensorflow --run "MODE [tape] [NAME=VALUE ...]" [--run ...]
    join_trainer.py --framework torch --mode sync --misuse

Each --run is one training, one after the other in the same ranks (starting a framework
on every rank costs more than the training), with its settings in the environment for
that run only; its JOIN-RESULT line carries the run's index.

--misuse: rank 1 joins after one step while rank 0 takes a second one, then averages a
metric (rank 1 takes part with zeros, as in Horovod: rank 0 prints JOIN-SERVED and the
value) and asks for a broadcast, which a joined rank refuses: rank 0 prints JOIN-MISUSE and
the error, and exits 3.
"""
import argparse
import json
import os
import sys

import numpy as np

FEATURES = 5
LR, MOMENTUM = 0.05, 0.9


def steps_of(epoch, rank, size):
    return 3 + rank if epoch == 0 else 2 + (size - 1 - rank)


def batch(epoch, rank, step):
    rng = np.random.default_rng([epoch, rank, step])
    n = 4 + rank
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.5).reshape(n, 1).astype(np.float32)
    return x, y


def initial():
    rng = np.random.default_rng(7)
    return rng.standard_normal((FEATURES, 1)).astype(np.float32), np.zeros(1, np.float32)


def run_torch(mode):
    import torch

    import eddis.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    w0, b0 = initial()
    model = torch.nn.Linear(FEATURES, 1)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w0.T.copy()))
        model.bias.copy_(torch.from_numpy(b0))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                         named_parameters=model.named_parameters(), mode=mode)
    if os.environ.get("EDDIS_CHECKPOINT_DIR"):   # its periodic checkpoints save this model
        hvd.resume(None, model, optimizer)
    lasts = []
    for epoch in range(2):
        for step in range(steps_of(epoch, hvd.rank(), hvd.size())):
            x, y = (torch.from_numpy(a) for a in batch(epoch, hvd.rank(), step))
            optimizer.set_sample_count(len(x))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        lasts.append(hvd.join())
        # every rank is past join(): collectives work again
        assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == hvd.size()
    if mode == "easgd":
        hvd.final_model()
    params = np.concatenate([model.weight.detach().numpy().T.reshape(-1), model.bias.detach().numpy()])
    optimizer.close()
    return hvd, lasts, params


def run_tensorflow(mode, tape_only=False):
    import keras
    import tensorflow as tf

    import eddis.tensorflow.keras as hvd

    hvd.init()
    w0, b0 = initial()
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.layers[0].set_weights([w0, b0])
    optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    if not tape_only:
        optimizer = hvd.DistributedOptimizer(optimizer, mode=mode)
    lasts = []
    for epoch in range(2):
        for step in range(steps_of(epoch, hvd.rank(), hvd.size())):
            x, y = batch(epoch, hvd.rank(), step)
            if not tape_only:
                optimizer.set_sample_count(len(x))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            if tape_only:
                tape = hvd.DistributedGradientTape(tape, mode=mode, sample_count=len(x))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        lasts.append(hvd.join())
        if tape_only:
            # a joined rank's own optimizer did not step: take the last rank's state, as in Horovod
            hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=lasts[-1])
        assert float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)[0]) == hvd.size()
    if mode == "easgd":
        optimizer.final_model()
    kernel, bias = model.layers[0].get_weights()
    if not tape_only:
        optimizer.close()
    return hvd, lasts, np.concatenate([kernel.reshape(-1), bias]).astype(np.float32)


def misuse(mode):
    import torch

    import eddis.torch as hvd
    from eddis.errors import UsageError

    hvd.init()
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), mode=mode)
    for step in range(2 if hvd.rank() == 0 else 1):
        x, y = (torch.from_numpy(a) for a in batch(0, hvd.rank(), step))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    if hvd.rank() != 0:
        hvd.join()
        sys.exit(0)
    print(f"JOIN-SERVED {hvd.allreduce(torch.tensor([1.0]), name='loss').item()}", flush=True)
    try:
        hvd.broadcast(torch.tensor([1.0]), root_rank=0, name="loss")
    except UsageError as exc:
        print(f"JOIN-MISUSE {exc}", flush=True)
        sys.exit(3)
    print("JOIN-MISUSE the broadcast returned", flush=True)
    sys.exit(4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("torch", "tensorflow"), required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--misuse", action="store_true")
    parser.add_argument("--tape", action="store_true", help="tensorflow: DistributedGradientTape, plain optimizer")
    parser.add_argument("--run", action="append", default=[], metavar='"MODE [tape] [NAME=VALUE ...]"')
    args = parser.parse_args()
    os.environ.update(item.split("=", 1) for item in args.set)
    if args.misuse:
        misuse(args.mode)
    runs = [run.split() for run in args.run] or [[args.mode, *(["tape"] if args.tape else [])]]
    for index, (mode, *options) in enumerate(runs):
        settings = dict(item.split("=", 1) for item in options if "=" in item)
        before = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        if args.framework == "torch":
            hvd, lasts, params = run_torch(mode)
        else:
            hvd, lasts, params = run_tensorflow(mode, tape_only="tape" in options)
        print("JOIN-RESULT " + json.dumps({"run": index, "rank": hvd.rank(), "size": hvd.size(), "lasts": lasts,
                                            "params": [float(v) for v in params]}), flush=True)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    hvd.shutdown()


if __name__ == "__main__":
    main()
