"""The one registry of runtime settings.

Every setting EDDIS or SMB reads from the environment is declared here, once,
with its type, default and meaning. Code reads settings through :func:`get`;
CLI flags map onto the same names (the launcher exports them as ``EDDIS_*`` to
the ranks). ``eddis settings`` prints the table and docs/user-guide.md holds a
copy that a test keeps in step with this file.
"""
import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ._boolenv import ACCEPTED as _BOOL_WORDS, parse_bool as _parse_bool
from .errors import ConfigError


def _bool(text):
    value = _parse_bool(text)
    if value is None:
        raise ConfigError(f"expected one of {_BOOL_WORDS}")
    return value


def _size(text):
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = int(float(t) * mult)
    if value < 0:
        raise ConfigError("must not be negative")
    return value


def _interval(text):
    """``("steps", n)`` from ``500``, ``("seconds", s)`` from ``600s``."""
    t = text.strip().lower()
    unit = "seconds" if t.endswith("s") else "steps"
    number = t[:-1] if unit == "seconds" else t
    try:
        value = float(number) if unit == "seconds" else int(number)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ConfigError("expected a positive number of steps ('500') or seconds ('600s')")
    return unit, value


def _bool_or_auto(text):
    """``auto`` (the code decides), else a boolean word."""
    return "auto" if text.strip().lower() == "auto" else _bool(text)


NUMERIC_TYPES = ("int", "float", "size")
PARSERS = {"bool": _bool, "bool/auto": _bool_or_auto, "int": int, "float": float, "str": str, "size": _size,
           "path": os.path.expanduser, "interval": _interval}


def number_text(value):
    """A bound as it is typed: whole numbers in full (``67108864``, not ``6.71089e+07``)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Setting:
    name: str
    type: str
    default: Any
    doc: str
    choices: Optional[Sequence[str]] = None
    flag: Optional[str] = None  # the eddis-train / eddis CLI flag that sets it
    internal: bool = False  # set by the launcher for the ranks, not by users
    min: Optional[float] = None  # numeric settings: the range of valid values
    max: Optional[float] = None
    above_min: bool = False  # min itself is not valid (> min: timeouts, rates)

    def _default_text(self):
        return "" if self.default is None else f" (default {self.default!r})"

    def range_text(self):
        """The valid values as a user reads them (``> 0``, ``>= 1``, ``2 to 8``), or None."""
        low = None if self.min is None else f"{'>' if self.above_min else '>='} {number_text(self.min)}"
        if self.max is None:
            return low
        high = number_text(self.max)
        if low is None:
            return f"<= {high}"
        return f"{low} and <= {high}" if self.above_min else f"{number_text(self.min)} to {high}"

    def check(self, value, given=None):
        """``value`` when it lies in the setting's choices and range; else a ConfigError that names
        the setting (or ``given``, e.g. the command-line flag that set it), the value and the range."""
        given = given or f"{self.name}={value!r}"
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"{given} is not one of {', '.join(map(str, self.choices))}; "
                f"set it to one of them or unset it (default {self.default!r})."
            )
        if self.type in NUMERIC_TYPES:
            allowed = self.range_text() or "a finite number"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{given} is not a finite number: {self.name} must be {allowed}"
                                  f"{self._default_text()}.")
            low_ok = self.min is None or (value > self.min if self.above_min else value >= self.min)
            if not (low_ok and (self.max is None or value <= self.max)):
                raise ConfigError(f"{given} is out of range: {self.name} must be {allowed}"
                                  f"{self._default_text()}.")
        return value

    def parse(self, text, given=None):
        """The typed value of ``text``, checked (:meth:`check`); ``given`` names where the text
        came from when that is not the variable (a command-line flag)."""
        given = given or f"{self.name}={text!r}"
        try:
            value = PARSERS[self.type](text)
        except ValueError as exc:  # int() and float() raise it; our parsers a ConfigError
            raise ConfigError(
                f"{given} is not a valid {self.type}: {exc}. "
                f"Set it to {'an' if self.type[0] in 'aeiou' else 'a'} {self.type} (default {self.default!r}) "
                "or unset it."
            ) from None
        return self.check(value, given)

    def flag_type(self, flag=None, keep_text=False):
        """An argparse ``type=`` for the flag that sets this setting: the registry's parser,
        choices and range, and an argparse error (exit status 2) that names the flag.
        ``keep_text``: the value stays as written once checked (``--memory 4G`` is exported
        as SMB_MEMORY=4G, not as a count of bytes)."""
        flag = flag or self.flag

        def parse_flag(text):
            try:
                value = self.parse(text, f"{flag} {text}")
            except ConfigError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            return text if keep_text else value

        parse_flag.__name__ = self.type
        return parse_flag


REGISTRY = {}


def register(name, type, default, doc, choices=None, flag=None, internal=False, min=None, max=None,
             above_min=False):
    if not (name.startswith("EDDIS_") or name.startswith("SMB_")):
        raise ConfigError(f"setting {name} must start with EDDIS_ or SMB_")
    if type not in PARSERS:
        raise ConfigError(f"setting {name}: unknown type {type}")
    if name in REGISTRY:
        raise ConfigError(f"setting {name} registered twice")
    if (min is not None or max is not None) and type not in NUMERIC_TYPES:
        raise ConfigError(f"setting {name}: a range is for numeric settings ({', '.join(NUMERIC_TYPES)})")
    setting = Setting(name, type, default, doc, tuple(choices) if choices else None, flag, internal, min, max,
                      above_min)
    if default is not None:
        setting.check(default)  # a default outside its own range is a mistake of this file
    REGISTRY[name] = setting
    return setting


def environ(env=None):
    """``env``, or the process environment when None (the mapping every accessor reads)."""
    return os.environ if env is None else env


def get(name, environ=None):
    """The typed value of a setting: from the environment, else its default."""
    try:
        setting = REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown setting {name}; known: {', '.join(sorted(REGISTRY))}") from None
    env = os.environ if environ is None else environ
    text = env.get(name)
    if text is None or text == "":
        return setting.default
    return setting.parse(text)


def check_environment(environ=None):
    """Fail early on a misspelt EDDIS_/SMB_ variable or a value that does not parse."""
    env = os.environ if environ is None else environ
    import difflib

    for key, text in env.items():
        if not key.startswith(("EDDIS_", "SMB_")):
            continue
        if key not in REGISTRY:
            near = difflib.get_close_matches(key, REGISTRY, n=1)
            hint = f" Did you mean {near[0]}?" if near else ""
            raise ConfigError(f"unknown setting {key} in the environment.{hint} Known settings: eddis settings")
        REGISTRY[key].parse(text)


def internal_variables():
    """The variables the launcher sets for the ranks (typed here, but not user settings)."""
    return {name for name, s in REGISTRY.items() if s.internal}


def markdown_table():
    rows = ["| setting | type | default | CLI flag | meaning |", "|---|---|---|---|---|"]
    for s in sorted(REGISTRY.values(), key=lambda s: s.name):
        if s.internal:
            continue
        default = "(unset)" if s.default is None else f"`{s.default}`"
        choices = f" One of: {', '.join(f'`{c}`' for c in s.choices)}." if s.choices else ""
        if s.range_text():
            choices += f" Range: `{s.range_text()}`."
        flag = f"`{s.flag}`" if s.flag else ""
        rows.append(f"| `{s.name}` | {s.type} | {default} | {flag} | {s.doc}{choices} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- general
register("EDDIS_RUN_DIR", "path", None,
         "Run directory of the job: SMB server addresses, the job token, profiles. "
         "Default: ~/.eddis/run/<SLURM_JOB_ID> (or local-<pid> outside Slurm).")
register("EDDIS_LOG_LEVEL", "str", "WARNING", "Log level of the eddis loggers.",
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])

# ---------------------------------------------------------------- installation and build (foundation)
register("EDDIS_HOME", "path", None,
         "Root of the EDDIS installation; set by `module load eddis` (the module's prefix).")
register("EDDIS_DEV_CLUSTER_DIR", "path", "/tmp/eddis-dev-cluster",
         "State directory of the local Slurm cluster of scripts/eddis-dev-cluster "
         "(slurm.conf, logs, spool, fake GPU devices); clients use SLURM_CONF=<dir>/slurm.conf.")
register("EDDIS_DEV_CLUSTER_PORT", "int", 16817,
         "TCP port of the local cluster's slurmctld; its slurmd n1, n2, ... use the next ones "
         "(base+1..base+nodes).", min=1024, max=65535 - 8)  # room for the 8 slurmd ports above it
register("EDDIS_DEV_CLUSTER_WAIT", "int", 60,
         "Seconds `eddis-dev-cluster up` waits for the nodes to become idle.", min=1)
register("EDDIS_DEV_CLUSTER_NET", "str", "auto",
         "Network mode of the local cluster: netns (each node its own network, UTS and mount "
         "namespace: own host name, own 198.18.0.0/15 address, a veth into a bridge), loopback "
         "(every node is 127.0.0.1 and this host's name), auto (netns where the machine allows "
         "it, else loopback, saying why).", choices=["auto", "netns", "loopback"])
register("EDDIS_DEV_CLUSTER_LINK", "str", "unlimited",
         "Rate of each node's link in netns mode (HTB qdisc on both ends of its veth: upload and "
         "download): `RATE` for every node, or `RATE,nK=RATE,...` with per-node overrides (e.g. "
         "`1gbit,n1=unlimited`); RATE is one of `unlimited`, `100mbit`, `1gbit`, `10gbit`.")
register("EDDIS_DEV_CLUSTER_NODES", "int", 2,
         "Nodes of the local cluster: n1 a100, n2 v100, then n3 h100, n4 a40, n5 l40s, n6 t4, "
         "n7 p100, n8 a10, each its own partition with 2 fake GPUs.", min=2, max=8)
for _lib, _what in (("UCX", "UCX (libucx-dev / ucx-devel)"), ("VERBS", "libibverbs (libibverbs-dev / rdma-core-devel)"),
                    ("MPI", "MPI (mpicc and mpi4py)"), ("CUDA", "the CUDA runtime")):
    register(f"EDDIS_WITH_{_lib}", "bool", False,
             f"Build time: require {_what}; the build stops naming the package when it is missing.")
    register(f"EDDIS_WITHOUT_{_lib}", "bool", False,
             f"Build time: build without {_what} even when it is installed. Neither set: auto-detect.")
del _lib, _what
register("EDDIS_UCX_HOME", "path", None,
         "Build time: the prefix of the UCX to build SMB against (its include/ and lib/ or lib64/), "
         "before pkg-config's and the system's; the extension gets an RPATH to it. On an InfiniBand "
         "cluster, the site's UCX with verbs; a process holds one libucp, and with MPI's UCX loaded "
         "first SMB uses that one (eddis doctor names it).")
register("EDDIS_BUILD_JOBS", "int", 0,
         "Build time: how many extensions compile at once; 0 is one per CPU the build may use.", min=0)

# ---------------------------------------------------------------- runtime (eddis.core)
register("EDDIS_MODE", "str", "sync",
         "Training algorithm: sync (gradients averaged through SMB), allreduce (MPI baseline), "
         "easgd, hybrid.", choices=["sync", "allreduce", "easgd", "hybrid"], flag="--mode")
register("EDDIS_COMPRESSION", "str", "none",
         "Wire format of gradients: none (fp32), fp16 or bf16; accumulation stays fp32.",
         choices=["none", "fp16", "bf16"], flag="--compression")
register("EDDIS_BUCKET_BYTES", "size", 25 << 20,
         "Bytes of fp32 gradients per communication bucket (suffix K/M/G); smaller buckets "
         "start communicating earlier in the backward pass.", min=1)
register("EDDIS_FIRST_BUCKET_BYTES", "size", 1 << 20,
         "The first bucket (the last layers' gradients, ready first in the backward pass) ends "
         "after the first layer that brings it to this size (suffix K/M/G), as DDP's first bucket "
         "of 1 MiB: a model that fits one EDDIS_BUCKET_BYTES bucket then starts communicating "
         "before its backward is over. 0: the first bucket is cut as any other.", max=1 << 30)
register("EDDIS_KEEP_FREED_MEMORY", "bool", True,
         "eddis.init(): tell the C heap (glibc) to serve large blocks from the heap and keep freed "
         "memory there, so that gradients allocated anew each step reuse pages already faulted in "
         "instead of a fresh mmap the kernel zeroes (the heap keeps its peak, as a caching allocator "
         "does). 0: leave the C heap's policy as it is.")
register("EDDIS_OVERLAP_OPTIMIZER", "str", "auto",
         "torch, where gradients are averaged (sync, allreduce, hybrid's groups): apply the wrapped "
         "optimizer's update bucket by bucket, as each "
         "bucket's averaged gradients arrive, while later buckets still cross the network. auto: "
         "for torch.optim's own per-parameter optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...); "
         "on: for any optimizer whose update of a parameter reads only that parameter's gradient "
         "and state; off: one update once the whole gradient is in. Never with a closure, optimizer "
         "step hooks or skip_synchronize().", choices=["auto", "on", "off"])
register("EDDIS_OVERLAP_FORWARD", "str", "off",
         "torch, sync and allreduce, with the update bucket by bucket (EDDIS_OVERLAP_OPTIMIZER): on: "
         "step() returns before the updates, and the next forward applies each bucket's just before "
         "a module that owns one of its parameters runs, while the gradients its later modules need "
         "still cross the network. A module's state_dict(), the optimizer's, EDDIS's checkpoints and "
         "optimizer.finish_step() apply them first; reading a parameter otherwise (p.data, an EMA "
         "copy) between step() and the next forward sees it before the update. off: step() returns "
         "with every update applied.", choices=["on", "off"])
register("EDDIS_COMM_TIMEOUT", "float", 300.0,
         "Seconds optimizer.step() and other collective calls wait for other ranks before "
         "raising TimeoutError.", min=0, above_min=True)
register("EDDIS_SYNC_REDUCE", "str", "auto",
         "How mode sync reduces a bucket: hierarchical (the ranks of a node sum in their node's "
         "server memory, then each node's sum crosses the network once to the servers that own "
         "its columns), ring (one rank a node: each node passes chunks of every bucket to the "
         "next node's server, one stream a link), ranks (every rank sums its share in the "
         "server memory it maps; needs all ranks and servers on one node), server (flat: every "
         "rank's slot goes to the servers, which sum) or auto (ranks on one node, the ring at one "
         "rank on each of 3 or more nodes, hierarchical across nodes otherwise).",
         choices=["auto", "hierarchical", "ring", "server", "ranks"])
register("EDDIS_CHECK_PARAMETERS", "int", 1000,
         "sync/allreduce: training steps between two checks that the ranks' parameters agree (a "
         "checksum per tensor, gathered over the ranks), counted by torch's DistributedOptimizer.step(), "
         "TensorFlow's DistributedOptimizer and DistributedGradientTape when eager, and "
         "BroadcastGlobalVariablesCallback in model.fit. The check also runs "
         "at shutdown and fails the run when they differ (nothing wrapped, or an update that "
         "bypasses the averaging). 0: off.", min=0)
register("EDDIS_EMBEDDED_SERVER", "bool", True,
         "When no SMB server has published itself in the run directory (plain mpirun on one "
         "node), start one inside local rank 0; 0 makes that an error instead.")

# ---------------------------------------------------------------- heterogeneity (easgd, hybrid, progress, balance)
register("EDDIS_EASGD_TAU", "int", 4,
         "easgd/hybrid: steps between two elastic-averaging exchanges of a worker (or group) "
         "with the centre variable.", min=1)
register("EDDIS_EASGD_ALPHA", "float", None,
         "easgd/hybrid: moving rate alpha of an exchange (d = alpha (x - centre)); unset: "
         "0.9 / (number of exchanging workers or groups), the EASGD paper's beta = 0.9.", min=0, above_min=True, max=1)
register("EDDIS_EASGD_OVERLAP", "bool/auto", "auto",
         "easgd/hybrid: after every step exchange one EDDIS_EASGD_TAU-th of the parameters (a "
         "stripe; each is exchanged every tau steps) in the background while the next step "
         "computes, and apply its move to the worker (group) after that step (waiting for it if "
         "need be); the centre moves as soon as the exchange is done. Hides the exchange's "
         "transfer behind the steps' compute, at the price of a worker move one step stale. "
         "auto: on when the centre crosses the network (some rank is not on the node of every "
         "smb-server), off when every rank maps every server's memory.")
register("EDDIS_EASGD_WEIGHTING", "str", "throughput",
         "easgd/hybrid: 'throughput' splits each exchange's move between worker and centre by the "
         "worker's measured throughput over the mean (fast workers move the centre more and are "
         "pulled back less); 'equal': plain EASGD, the same move for both.",
         choices=["throughput", "equal"])
register("EDDIS_TOTAL_ITERATIONS", "int", None,
         "Total training iterations (one local mini-batch of one rank each) for the global "
         "learning counter; eddis.should_stop() ends training when they are used up.", min=1)
register("EDDIS_CLAIM_CHUNK", "int", 1,
         "Iterations (group steps in sync/hybrid) a worker claims from the global learning "
         "counter at once; larger chunks mean fewer counter round trips.", min=1)
register("EDDIS_CLAIM_AHEAD", "bool", True,
         "The leader of ranks that step together claims its next chunk from the global learning "
         "counter in the background while it runs the current chunk's last step (never in elastic "
         "runs); 0: claim only when the chunk is used up, so that claims follow the steps exactly.")
register("EDDIS_STALENESS", "int", -1,
         "Staleness bound s: no rank starts step t while another is before step t - s; "
         "-1: unbounded.", min=-1)
register("EDDIS_CHECKPOINT_DIR", "path", None,
         "Folder of the periodic and requested checkpoints (eddis.checkpoint/eddis.resume); set, "
         "eddis.init() also installs the SIGUSR1 handler that asks for a checkpoint and a stop.")
register("EDDIS_CHECKPOINT_INTERVAL", "interval", None,
         "Periodic checkpoints into EDDIS_CHECKPOINT_DIR: every N optimizer steps ('500'), or "
         "every N seconds ('600s'), by rank 0's steps or clock (in an elastic run that lost rank 0, "
         "the lowest live rank's); unset: none (requests only).")
register("EDDIS_CHECKPOINT_KEEP", "int", 3,
         "Complete checkpoints kept in EDDIS_CHECKPOINT_DIR; older ones are removed after each "
         "new one is committed (0: keep all).", min=0)
register("EDDIS_ELASTIC", "bool", False,
         "easgd/hybrid: when a rank dies (or a hybrid group, whose synchronous reductions its dead "
         "member stops), the other ranks train on against the centre variable until the global "
         "learning counter reaches the total, and eddis-train reports the run as finished degraded, "
         "naming the lost ranks (exit status 0). Refused in sync/allreduce, which restart from the "
         "last checkpoint instead (EDDIS_MAX_RESTARTS). Needs the launcher's smb-servers.")
register("EDDIS_ELASTIC_LOST_AFTER", "float", 30.0,
         "Elastic runs: seconds a rank's heartbeat in SMB may stay still before the others count "
         "it as lost and stop waiting for it (staleness bound, checkpoints, final model, shutdown; "
         "a hybrid group then stops). As EDDIS_LIVENESS_TIMEOUT: the beat is a Python thread, so a call "
         "that holds the GIL longer than this makes a live rank look lost. Before a rank's training "
         "started its supervisor beats in the run dir instead, and a beat still for this long (at most "
         "half of EDDIS_LIVENESS_TIMEOUT) fails the start: its node was lost.", min=0, above_min=True)
register("EDDIS_ELASTIC_MIRROR", "bool", True,
         "Elastic runs on more than one smb-server: keep the training state in SMB (the centre "
         "variable, the learning and staleness counters, the heartbeats, the checkpoint schedule's "
         "counters) on two servers each, so "
         "that the survivors of a node lost with its smb-server train on. Costs twice that memory, "
         "one more write of the worker's move per easgd exchange (3 instead of 2 times the "
         "parameter bytes: the centre read once, the move written twice) and one more round trip "
         "per counter update; 0: a lost smb-server fails the run.")
register("EDDIS_BALANCE", "bool", False,
         "sync: give each rank a share of the global batch proportional to its measured "
         "throughput (balanced sync); hybrid: the same inside each group, with the group's batch.")
register("EDDIS_BALANCE_WARMUP", "int", 5,
         "Balanced sync: steps measured before the first rebalancing (the first step is not counted).", min=1)
register("EDDIS_BALANCE_INTERVAL", "int", 50,
         "Balanced sync: steps between two re-measurements of the ranks' throughput.", min=1)
register("EDDIS_BALANCE_SMOOTHING", "float", 0.5,
         "Balanced sync: weight of a new measurement when shares are updated "
         "(1: jump to the measured shares, smaller: move towards them gradually).", min=0, above_min=True, max=1)
register("EDDIS_SIMULATE_SLOWDOWN", "str", None,
         "TESTING AID: make ranks compute slower by sleeping (factor-1) x their measured compute "
         "time per step, e.g. '0:1.0,1:2.0' (rank:factor) or 'g1:2.0' (group:factor); "
         "simulates mixed GPU generations on identical hardware.")

# ---------------------------------------------------------------- SMB
register("SMB_TIMEOUT", "float", 60.0,
         "Seconds any SMB wait (connect, reply, barrier, event) may take before it raises TimeoutError.",
         min=0, above_min=True)
register("SMB_CONNECT_TIMEOUT", "float", 60.0,
         "Seconds a client waits for all servers of the job to publish their addresses.", min=0, above_min=True)
register("SMB_MEMORY", "size", 1 << 30,
         "Bytes of memory each smb-server lends (suffix K/M/G).", flag="--memory", min=1)
register("SMB_PORT", "int", 0, "TCP port an smb-server listens on (0: any free port).", flag="--port", min=0, max=65535)
register("SMB_HUGEPAGES", "str", "off",
         "Huge pages for an smb-server's memory: hugetlb (explicit pages reserved with "
         "vm.nr_hugepages; refused when too few are free), transparent (madvise on the shared "
         "memory; refused when the kernel's shmem_enabled policy is never or deny), auto "
         "(hugetlb, else transparent, else normal pages with a warning) or off. The server logs "
         "what it got, read back from /proc/self/smaps.",
         choices=["off", "auto", "hugetlb", "transparent"], flag="--hugepages")
register("SMB_REDUCE_THREADS", "int", 0,
         "Threads an smb-server uses for each large vector operation (the reduction of a bucket, "
         "axpy, scale, copy), its request thread included; 1 reduces on the request thread alone. "
         "0 (auto): half the CPUs the server may run on, at most 8, since the trainers of the node "
         "need the other half and a few threads already saturate a socket's memory bandwidth.",
         flag="--reduce-threads", min=0, max=256)  # the native core's SMB_VECPOOL_MAX_THREADS
register("SMB_LOCAL_MAP", "bool", True,
         "Map the memory of a server on the same host directly (zero-copy). "
         "0 forces every transfer through the network transport, to test the remote path on one "
         "machine.")
register("SMB_TRANSPORT", "str", "auto",
         "How clients reach an smb-server that is not mapped. `socket`: requests and data over one "
         "TCP connection per server, opened only after a challenge-response proof of the job token, "
         "every byte checked and copied by the server. `rdma`: the same proven connection for "
         "requests and, per region, its remote key; bulk put/get one-sided through UCX (InfiniBand/"
         "RoCE between nodes, shared memory inside one; never UCX's tcp, see SMB_UCX_ALLOW_TCP). "
         "`auto`: rdma where every node of the job has an active InfiniBand or RoCE port that UCX "
         "can use, else socket (`eddis doctor` says which and why). The former `ucx` is refused: it "
         "served one-sided access before the token proof.", choices=("auto", "socket", "rdma"))
register("SMB_SOCKET_UNSENT", "size", 2 << 20,
         "Socket transport: the most bytes of a connection the kernel may hold that are not on the "
         "wire yet (TCP_NOTSENT_LOWAT; suffix K/M; 0: the kernel's own limit, several MiB). SMB "
         "sends a request (a read, a reduction) ahead of the puts it has queued, but not ahead of "
         "what the kernel holds already: a smaller figure lets a request wait less behind bulk "
         "data, a larger one needs fewer wakeups on fast links.", max=64 << 20)
register("SMB_SERVER_SPIN_US", "float", 0.0,
         "Socket transport: microseconds an smb-server keeps polling its sockets without sleeping "
         "after something moved, so that the next request of a burst costs no wakeup. Worth it where "
         "the server has a core of its own; where it shares the node's cores with the trainers (0, "
         "the default), they get that time: each poll is a system call.", min=0, max=10000)
register("SMB_UCX_ALLOW_TCP", "bool", False,
         "UNSAFE, FOR TESTS ONLY: let the rdma transport use UCX's tcp transport, whose one-sided "
         "writes check no key and no address, so any peer that reaches its port can write anywhere "
         "in the smb-server. For running the rdma code paths between hosts without InfiniBand.")
register("SMB_GPU_DIRECT", "bool", False,
         "rdma transport: pool put/get straight from and into CUDA memory (GPUDirect: a buffer "
         "with __cuda_array_interface__, a torch CUDA tensor) where UCX has its CUDA transports "
         "(cuda_copy, cuda_ipc; `eddis doctor` says). Off: such a buffer is refused and the "
         "framework adapters stage through pinned host memory. Off until measured on a GPU "
         "cluster; never run on InfiniBand here.")
register("SMB_HANDSHAKE_TIMEOUT", "float", 10.0,
         "Seconds a new connection to an smb-server has to prove the job token before it is dropped.",
         min=0, above_min=True)

# ---------------------------------------------------------------- observability (eddis.timeline)
register("EDDIS_TIMELINE", "path", None,
         "Directory for Chrome-trace timeline files of every rank and SMB server; unset: off. "
         "Merge them with `eddis prof merge DIR`.", flag="--timeline")
register("EDDIS_TIMELINE_BUFFER", "int", 1 << 20,
         "Timeline events buffered in memory per process before new ones are dropped (and counted).", min=1)
register("EDDIS_TIMELINE_MODULE_HOOKS", "bool", False,
         "Record forward/backward of every top-level module (PyTorch hooks) in the timeline.")
register("EDDIS_PROFILE", "bool", False,
         "Record per-step, per-rank times, samples and bytes into <run dir>/profile.h5 "
         "(read it with `eddis prof report`).", flag="--profile")
register("EDDIS_PROFILE_FILE", "path", None,
         "Where the merged HDF5 profile goes (default: <run dir>/profile.h5).")
register("EDDIS_PROGRESS", "str", "auto",
         "Rank 0 progress display: a tqdm bar on a terminal and log lines otherwise (auto), "
         "always one of them (bar, log), or none (off).", choices=["auto", "bar", "log", "off"])
register("EDDIS_PROGRESS_INTERVAL", "float", 30.0,
         "Seconds between two progress log lines when stdout is not a terminal.", min=0)

# ---------------------------------------------------------------- launcher (eddis.launch)
# What eddis-train exports to each rank (eddis.launch.rankenv); read through eddis.identity.
register("EDDIS_RANK", "int", None, "This rank's place in the job (the launcher's).", internal=True, min=0)
register("EDDIS_SIZE", "int", None, "Ranks in the job (the launcher's).", internal=True, min=1)
register("EDDIS_LOCAL_RANK", "int", None, "This rank's place among its node's ranks.", internal=True, min=0)
register("EDDIS_LOCAL_SIZE", "int", None, "Ranks on this node.", internal=True, min=1)
register("EDDIS_GROUP", "int", None, "This rank's group: hetjob component, else node.", internal=True, min=0)
register("EDDIS_NUM_GROUPS", "int", None, "Groups in the job.", internal=True, min=1)
register("EDDIS_GROUP_SIZE", "int", None, "Ranks in this rank's group.", internal=True, min=1)
register("EDDIS_HOST_GROUPS", "str", None, "The trainer nodes of an elastic Slurm job (mpirun): "
         "node:group:ranks, comma-separated (eddis.launch.mpirun_step).", internal=True)
register("EDDIS_HOSTNAME", "str", None, "The node this rank is on (eddis.identity.node_name).",
         internal=True)
register("EDDIS_LAUNCHED", "bool", False, "Set for processes eddis-train started.", internal=True)
register("EDDIS_STARTED_FILE", "path", None,
         "Elastic runs: where this rank notes that its training started (it passed the set-up every "
         "rank takes part in; eddis.smb.rundir.note_training_started). A rank lost before then fails "
         "the start, since the others may wait for it in a start-up collective.", internal=True)
register("EDDIS_INIT_FILE", "path", None,
         "Where this rank notes that eddis.init() returned (MPI's start-up is over; "
         "eddis.smb.rundir.note_initialized). A rank that crashed before then is a start-up crash "
         "(EDDIS_START_RETRIES).", internal=True)
register("EDDIS_START_RETRIES", "int", 1,
         "How many times a job (eddis-train --job or --local) starts its smb-servers and trainers "
         "again when the root cause "
         "of their failure is a rank that crashed (SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE) before "
         "eddis.init() returned. Open MPI 4.1 under Slurm's PMIx rarely crashes inside MPI_Init "
         "(about one start in 250 on a loaded node, docs/reliability.md). Counted apart from "
         "EDDIS_MAX_RESTARTS; 0: never.", min=0)
register("EDDIS_STOP_GRACE", "float", 5.0,
         "Seconds a trainer gets after SIGTERM (a peer failed, or the job was cancelled) "
         "before eddis-train kills it with SIGKILL.", min=0)
register("EDDIS_INTERRUPT_GRACE", "float", 30.0,
         "Seconds a trainer gets after SIGINT (Ctrl-C on eddis-train --local, an interrupted job) "
         "to run its own KeyboardInterrupt handler before eddis-train sends SIGTERM "
         "(then SIGKILL after EDDIS_STOP_GRACE).", min=0)
register("EDDIS_STEP_END_GRACE", "float", 30.0,
         "Seconds the job waits for the trainers' srun to return after every rank recorded "
         "its exit (3 s once Slurm lists the step no more); then it ends srun and takes the job status "
         "from the ranks' exit records.", min=0)
register("EDDIS_SERVER_WAIT", "float", 120.0,
         "Seconds a job (eddis-train --job, or --local) waits for every smb-server to publish its "
         "address before it fails "
         "(with the servers' lines above the message); raise it for a slow node or file system.",
         min=0, above_min=True)
register("EDDIS_REQUEUE", "bool", True,
         "Whether a Slurm job whose trainers wrote a checkpoint on the job's warning signal "
         "(#SBATCH --signal=B:USR1@N, which eddis submit writes) requeues itself "
         "(scontrol requeue), so that its next run resumes from that checkpoint.")
register("EDDIS_MAX_REQUEUES", "int", 20,
         "How many times one job may requeue itself after its time-limit warning (Slurm's "
         "SLURM_RESTART_COUNT, less the job's preemptions, which are never refused); a job past it "
         "ends with its checkpoint kept and says so, instead of cycling through the queue.", min=0)
register("EDDIS_CHECKPOINT_GRACE", "float", 120.0,
         "Seconds a job's trainers get, after SIGTERM reaches the job's steps but not its batch "
         "script (Slurm's preemption within the partition's GraceTime, scancel --signal=TERM), to "
         "reach their next step boundary and write a checkpoint into EDDIS_CHECKPOINT_DIR before "
         "eddis-train stops them; the smb-servers, which hold the state the checkpoint reads, stay "
         "up meanwhile. Only with EDDIS_CHECKPOINT_DIR; keep it below the partition's GraceTime.", min=0)
register("EDDIS_CHECKPOINT_ON_SIGTERM", "bool", False,
         "Set by eddis-train for its trainer in a Slurm job step with EDDIS_CHECKPOINT_DIR: "
         "eddis.init() makes the first SIGTERM a checkpoint-and-stop request.", internal=True)
register("EDDIS_MAX_RESTARTS", "int", 0,
         "How many times a job (eddis-train --job or --local) starts its smb-servers and trainers "
         "again after the trainers failed, within the same allocation (as torchrun --max-restarts); "
         "a script that calls eddis.resume() continues from its last checkpoint. 0: never.", min=0)
register("EDDIS_SPARE_NODES", "int", 0,
         "Nodes of a Slurm job's allocation its trainers leave unused, so that a restart "
         "(EDDIS_MAX_RESTARTS) can run without a node that failed (DOWN, DRAIN, FAIL, not "
         "responding, or removed from a --no-kill job) and keep the job's layout; the batch host is "
         "the first spare. eddis submit --spare-nodes K writes it, K more nodes and --no-kill. A job "
         "of one hetjob component only.", min=0)
register("EDDIS_RESTART_COUNT", "int", 0,
         "How many times the launcher has restarted the trainers in this allocation "
         "(EDDIS_MAX_RESTARTS and EDDIS_START_RETRIES together).", internal=True, min=0)
register("EDDIS_LIVENESS_TIMEOUT", "float", 30.0,
         "Seconds a trainer or smb-server may go without a heartbeat to its eddis-train supervisor "
         "(or stay stopped, e.g. by SIGSTOP) before it counts as hung: its Python stack is dumped, it "
         "is killed and named as the job's root cause. Independent of EDDIS_COMM_TIMEOUT; 0: off.", min=0)
register("EDDIS_GPU_TYPE", "str", None,
         "GPU generation of the ranks (e.g. a100); eddis-train sets it per rank from the "
         "node's GRES or partition, `cpu` when no GPU is bound. Set it to override.")
