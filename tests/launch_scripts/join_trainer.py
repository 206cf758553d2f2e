"""Uneven batches per rank, then join(): run by tests/test_join.py under eddis-train --local.

Two epochs of a linear least-squares model with momentum SGD. In epoch 0 rank r takes
3 + r steps, in epoch 1 2 + (size - 1 - r), each on its own batch of 4 + r samples
(seeded by epoch, rank and step, so the test can recompute every one), with the
sample count as its weight; then every rank calls join(). Prints one JOIN-RESULT line:
the ranks join() named last in each epoch and the final parameters (fp32).

    join_trainer.py --framework torch|tensorflow [--mode sync|allreduce|easgd]
"""
import argparse
import json

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
    return hvd, lasts, params


def run_tensorflow(mode):
    import keras
    import tensorflow as tf

    import eddis.tensorflow.keras as hvd

    hvd.init()
    w0, b0 = initial()
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.layers[0].set_weights([w0, b0])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), mode=mode)
    lasts = []
    for epoch in range(2):
        for step in range(steps_of(epoch, hvd.rank(), hvd.size())):
            x, y = batch(epoch, hvd.rank(), step)
            optimizer.set_sample_count(len(x))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        lasts.append(hvd.join())
        assert float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)[0]) == hvd.size()
    if mode == "easgd":
        optimizer.final_model()
    kernel, bias = model.layers[0].get_weights()
    return hvd, lasts, np.concatenate([kernel.reshape(-1), bias]).astype(np.float32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("torch", "tensorflow"), required=True)
    parser.add_argument("--mode", default="sync")
    args = parser.parse_args()
    hvd, lasts, params = (run_torch if args.framework == "torch" else run_tensorflow)(args.mode)
    print("JOIN-RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "lasts": lasts,
                                        "params": [float(v) for v in params]}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
