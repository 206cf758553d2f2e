"""A TensorFlow trainer whose ``tf.function`` fails on rank 1: traced with a tensor that
cannot take the reshape's shape (``--when trace``: "in user code:"), or running a gather out
of range (``--when run``: "Graph execution error:"). Rank 0 waits in the allreduce after it."""
import argparse

import tensorflow as tf

import eddis.tensorflow as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--when", choices=("trace", "run"), required=True)
when = parser.parse_args().when
hvd.init()
bad = hvd.rank() == 1


@tf.function
def traced_step(x):
    y = tf.reshape(x, [3, 5])   # the failing line, traced
    return hvd.allreduce(y)


@tf.function
def running_step(x, index):
    y = tf.gather(x, index)   # the failing line, run
    return hvd.allreduce(y)


if when == "trace":
    traced_step(tf.zeros([4, 4] if bad else [3, 5]))
else:
    running_step(tf.zeros([4, 4]), tf.constant([7 if bad else 1]))
print("never reached by rank 1")
