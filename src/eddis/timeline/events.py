"""Names of the timeline events, shared by the runtime, the SMB server and the report.

Every instrumented point in EDDIS uses one of these names, so a trace reads the
same whatever code path produced it and the merge/report tools can find events
by name. Arguments that go with them: ``step`` (training step), ``bucket``
(gradient bucket id), ``bytes`` (payload size), ``generation`` (reduction round).
"""

# -- trainer compute (main thread)
STEP = "step"                      # one training step, end to end
FORWARD = "forward"                # forward pass (module hooks, optional)
BACKWARD = "backward"              # backward pass (module hooks, optional)
OPTIMIZER_STEP = "optimizer_step"  # the local optimizer.step()

# -- gradient path (communication thread)
BUCKET_READY = "bucket_ready"      # instant: a bucket's gradients are all computed
COMPRESS = "compress"              # fp32 -> fp16/bf16 before the push
DECOMPRESS = "decompress"          # back to fp32 after the pull
PUSH = "push"                      # write this worker's slot of a bucket into SMB
REDUCE = "reduce"                  # weighted sum / average of a bucket (server; ranks on one node: cat comm)
AXPY = "axpy"                      # server-side y += alpha x (EASGD centre update)
PULL = "pull"                      # read the reduced bucket back
ALLREDUCE = "allreduce"            # MPI allreduce baseline mode
BROADCAST = "broadcast"            # parameter / state broadcast

# -- waiting and synchronization
WAIT = "wait"                      # the training thread blocked on communication
BARRIER = "barrier"                # an SMB or MPI barrier
EASGD_EXCHANGE = "easgd_exchange"  # one elastic-averaging exchange with the centre
COUNTER_CLAIM = "counter_claim"    # claiming iterations from the global learning counter

# -- categories (the "cat" field; viewers can filter on them)
CAT_COMPUTE = "compute"
CAT_COMM = "comm"
CAT_WAIT = "wait"
CAT_SERVER = "server"
CAT_SYNC = "sync"

ALL_EVENTS = (
    STEP, FORWARD, BACKWARD, OPTIMIZER_STEP, BUCKET_READY, COMPRESS, DECOMPRESS, PUSH,
    REDUCE, AXPY, PULL, ALLREDUCE, BROADCAST, WAIT, BARRIER, EASGD_EXCHANGE, COUNTER_CLAIM,
)

DEFAULT_CATEGORY = {
    STEP: CAT_COMPUTE, FORWARD: CAT_COMPUTE, BACKWARD: CAT_COMPUTE, OPTIMIZER_STEP: CAT_COMPUTE,
    BUCKET_READY: CAT_COMPUTE, COMPRESS: CAT_COMM, DECOMPRESS: CAT_COMM, PUSH: CAT_COMM,
    REDUCE: CAT_SERVER, AXPY: CAT_SERVER, PULL: CAT_COMM, ALLREDUCE: CAT_COMM,
    BROADCAST: CAT_COMM, WAIT: CAT_WAIT, BARRIER: CAT_SYNC, EASGD_EXCHANGE: CAT_COMM,
    COUNTER_CLAIM: CAT_SYNC,
}
