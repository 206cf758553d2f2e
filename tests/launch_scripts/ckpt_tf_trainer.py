"""The TensorFlow trainer of tests/test_checkpoint_resume.py: a small Keras MLP trained in sync
with eddis.DistributedOptimizer in eager steps (SGD with momentum: the optimizer state matters),
each rank on its half of every global batch of 8.

    eddis-train --local -n 2 python ckpt_tf_trainer.py --out DIR --steps N [--ckpt DIR]
        [--checkpoint-at K [--go-on]]

Each rank writes ``DIR/rank-R.json``: the resumed step and its final weights. ``--go-on``
trains on to step N after the checkpoint at K instead of stopping there, so one launch
gives both the checkpoint and the uninterrupted run's result.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--checkpoint-at", type=int, default=None)
    ap.add_argument("--go-on", action="store_true")
    args = ap.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf
    import eddis.tensorflow as eddis

    eddis.init()
    rank = eddis.rank()
    os.makedirs(args.out, exist_ok=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), mode="sync")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    eddis.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8 * args.steps, 6)).astype("float32")
    y = rng.integers(0, 3, 8 * args.steps).astype("int64")
    start = eddis.resume(args.ckpt, model, optimizer) if args.ckpt else None
    first = start.step if start is not None else 0
    for step in range(first, args.steps):
        sl = slice(step * 8 + rank * 4, step * 8 + rank * 4 + 4)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[sl], model(x[sl], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if step + 1 == args.checkpoint_at:
            eddis.checkpoint(args.ckpt, model, optimizer)
            if not args.go_on:
                break
    weights = np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables]).tolist()
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"start": first, "params": weights,
                   "iterations": int(np.asarray(optimizer.iterations))}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
