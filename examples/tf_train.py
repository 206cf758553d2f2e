"""Train a small Keras CNN on scikit-learn's bundled digits data set with EDDIS.

Runs anywhere EDDIS runs (nothing is downloaded):

    mpirun -n 2 python examples/tf_train.py                 # plain MPI, embedded SMB server
    eddis-train --local -n 2 examples/tf_train.py            # the EDDIS launcher, no Slurm
    srun --mpi=pmix eddis-train examples/tf_train.py         # inside scripts/eddis_job.sh

``--loop fit`` (default) trains with ``model.fit``; ``--loop tape`` with a
``tf.GradientTape`` loop. ``--mode easgd`` or ``hybrid`` (mixed GPU
generations) trains for a number of iterations counted by the global learning
counter instead of epochs, and evaluates the centre variable. Every line that
differs from single-process Keras is marked ``# EDDIS``;
docs/tensorflow-conversion.md walks through them. Expected result with the
defaults (15 epochs, global batch 64): test accuracy about 0.97 on any number
of ranks.
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import eddis.tensorflow as eddis  # noqa: E402  EDDIS


def make_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("linear", dtype="float32"),  # float32 logits under mixed precision
    ])


def load_data():
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", default="fit", choices=["fit", "tape"])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks together)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--mode", default=None,
                        help="sync, allreduce, easgd or hybrid (default: EDDIS_MODE)")
    parser.add_argument("--compression", default=None, choices=["none", "fp16", "bf16"],
                        help="gradient wire format (default: EDDIS_COMPRESSION)")
    parser.add_argument("--precision", default="float32",
                        choices=["float32", "mixed_float16", "mixed_bfloat16"])
    parser.add_argument("--shares", default=None,
                        help="per-rank shares of every batch, e.g. 1,2 (default: equal)")
    parser.add_argument("--balance", action="store_true",
                        help="sync, --loop fit: shares of each global batch follow each rank's speed")
    parser.add_argument("--iterations", type=int, default=None,
                        help="easgd/hybrid: total iterations of all ranks (default: as many "
                             "local batches as the epochs hold)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    eddis.init()  # EDDIS
    rank, size = eddis.rank(), eddis.size()  # EDDIS
    mode = args.mode or os.environ.get("EDDIS_MODE", "sync")
    if args.balance and (args.loop != "fit" or mode not in ("sync", "allreduce") or args.shares):
        parser.error("--balance needs --loop fit, mode sync or allreduce, and no --shares")
    keras.mixed_precision.set_global_policy(args.precision)
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data()

    shares = [float(s) for s in args.shares.split(",")] if args.shares else None  # EDDIS
    local_batch = eddis.local_batch_size(args.batch_size, shares)  # EDDIS: this rank's part
    steps = len(x_train) // args.batch_size
    train_set = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    # the same seed on every rank: one order, cut into per-rank parts of each global batch
    train_set = train_set.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True)

    model = make_model()
    compression = getattr(eddis.Compression, args.compression) if args.compression else None
    optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
    elastic = mode in ("easgd", "hybrid")
    if args.loop == "fit" or elastic:  # (a tape loop in sync mode reduces in the tape instead)
        optimizer = eddis.DistributedOptimizer(optimizer, mode=mode, compression=compression,  # EDDIS
                                               balance=args.balance)
        if not args.balance:
            optimizer.set_sample_count(local_batch)  # EDDIS: weight of this rank in the average
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if elastic:  # EDDIS: ranks train at their own pace; the global counter ends training
        total = args.iterations or args.epochs * steps * size
        data = eddis.shard_batches(train_set.repeat(), args.batch_size, shares)  # EDDIS
        epochs, progress = 1, eddis.callbacks.ProgressControlCallback(total=total)  # EDDIS
        if args.loop == "tape":
            eddis.configure_progress(total=total)  # EDDIS: what the callback does for fit
    elif args.balance:  # EDDIS: each global batch cut by the measured speeds
        data = eddis.balanced_batches(train_set, args.batch_size, optimizer)
        epochs, progress = args.epochs, None
    else:
        data = eddis.shard_batches(train_set, args.batch_size, shares)  # EDDIS
        epochs, progress = args.epochs, None

    start = time.perf_counter()
    if args.loop == "fit":
        model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"],
                      jit_compile=False)  # EDDIS: the reduction runs outside XLA
        callbacks = [eddis.callbacks.BroadcastGlobalVariablesCallback(0),  # EDDIS
                     eddis.callbacks.MetricAverageCallback()]  # EDDIS
        if progress is not None:
            callbacks.append(progress)
        history = model.fit(data, epochs=epochs, callbacks=callbacks, shuffle=False,
                            verbose=2 if rank == 0 and not elastic else 0)  # EDDIS: rank 0 prints
        done_steps = progress.steps if progress is not None else epochs * steps
        last_loss = history.history["loss"][-1]
    else:
        done_steps, last_loss = train_with_tape(model, optimizer, loss_fn, data, epochs, elastic, rank,
                                                mode, compression)
    elapsed = time.perf_counter() - start

    eddis.final_model(optimizer)  # EDDIS: easgd/hybrid: the centre variable; sync: as is
    logits = model.predict(x_test, batch_size=256, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    counts = eddis.progress_counts() if elastic else None  # EDDIS
    shares_now = optimizer.hetero.balancer.shares.round(3).tolist() if args.balance else None
    if rank == 0:
        if shares_now is not None:
            print(f"balanced shares: {shares_now}", flush=True)
        print(f"ranks {size}  mode {mode}  loop {args.loop}  "
              f"precision {args.precision}  last train loss {last_loss:.4f}", flush=True)
        if counts is not None:
            print(f"iterations by rank: {counts}", flush=True)
        print(f"{done_steps * local_batch * size / elapsed:.0f} samples/s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    eddis.shutdown()  # EDDIS


def train_with_tape(model, optimizer, loss_fn, data, epochs, elastic, rank, mode, compression):
    """The GradientTape version of the loop (what model.fit does above)."""
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if not elastic:
            tape = eddis.DistributedGradientTape(tape, mode=mode, compression=compression,  # EDDIS
                                                 sample_count=tf.shape(x)[0])
        # easgd/hybrid move the parameters after the update: the wrapped optimizer does
        # that, and takes the plain tape's gradients
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    eddis.broadcast_variables(model.variables, root_rank=0)  # EDDIS
    optimizer.build(model.trainable_variables)
    eddis.broadcast_variables(optimizer.variables, root_rank=0)  # EDDIS
    steps = 0
    loss = 0.0
    if elastic:
        iterator = iter(data)
        while not eddis.should_stop():  # EDDIS: the global learning counter
            x, y = next(iterator)
            loss = float(train_step(x, y))
            steps += 1
        return steps, loss
    for epoch in range(epochs):
        total = 0.0
        batches = 0
        for x, y in data:
            total += float(train_step(x, y))
            batches += 1
        loss = float(eddis.allreduce(tf.constant(total / batches)))  # EDDIS: mean over ranks
        steps += batches
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  train loss {loss:.4f}", flush=True)
    return steps, loss


if __name__ == "__main__":
    main()
