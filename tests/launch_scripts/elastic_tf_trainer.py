"""The TensorFlow easgd trainer of the elastic tests (EDDIS_ELASTIC=1 under eddis-train --local):
tests/launch_scripts/elastic_trainer.py's loop with a Keras model and eddis.tensorflow.

``--kill-rank R --kill-step S`` and ``--await-loss``: see elastic_steps.py. ``--resume PATH``:
eddis.resume(PATH) before training (a checkpoint, or a folder of them), which also gives the
periodic checkpoints (EDDIS_CHECKPOINT_INTERVAL) the model to save. Every survivor writes ``<out>/<rank>.json``:
its steps, the global learning counter at the end, its Start and its distance to the truth; the
final model (the centre) goes to ``<out>/model.keras`` through eddis.save_model.
"""
import argparse
import json
import os

import elastic_steps

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--total", type=int, default=300)
elastic_steps.add_arguments(p)
p.add_argument("--resume", default=None)
args = p.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import eddis.tensorflow as eddis  # noqa: E402

eddis.init()
rank = eddis.rank()
keras.utils.set_random_seed(0)
truth = np.random.default_rng(0).normal(size=(16, 1)).astype("float32")
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5), mode="easgd")
eddis.broadcast_variables(model.variables, root_rank=0)
start = eddis.resume(args.resume, model, optimizer) if args.resume else None
ctl = eddis.configure_progress(total=args.total)
rng = np.random.default_rng(100 + rank)
step = 0
while not eddis.should_stop():
    elastic_steps.before_step(args, rank, step)
    x = rng.normal(size=(32, 16)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - x @ truth) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    step += 1
# collective: every live rank has stopped claiming, so the counter reads the total (a rank that
# reads it alone may see another's claim that crossed the total before its surplus goes back)
eddis.save_model(os.path.join(args.out, "model.keras"), model, optimizer)
with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "steps": ctl.steps_done, "counter": ctl.counter.read(),
               "start": None if start is None else {"path": start.path, "step": start.step},
               "error": float(np.linalg.norm(model.get_weights()[0] - truth))}, f)
print(f"rank {rank} finished after {ctl.steps_done} steps")
