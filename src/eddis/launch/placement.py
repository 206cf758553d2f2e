"""The nodes of its allocation a job runs its smb-servers and trainers on, and which it leaves out.

A job may hold spare nodes (``EDDIS_SPARE_NODES``, ``eddis submit --spare-nodes K``): K more
nodes than its trainers use, so that a restart (``EDDIS_MAX_RESTARTS``) can leave a failed
node out and keep the job's layout, the same number of nodes and ranks, which a ``sync`` run
needs to resume its checkpoint. Before each restart the job asks Slurm which of its nodes
failed (:mod:`eddis.slurm.nodes`) and plans again without them.

Which nodes are used: the healthy ones in the allocation's order, the batch host (the first
node, where ``eddis-train --job`` itself runs) last. Its failure ends the job whatever runs
there (the job's script dies with it), so it is the natural spare; and when a node that is
not the batch host fails, the trainers move to the batch host or another spare.

A job of several hetjob components has no spares: each component's nodes hold its GPU type,
and its trainers use them all, so a failed node there leaves too few.
"""
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from ..errors import ConfigError, NodeFailureError
from .hostlist import expand_hostlist, expand_tasks_per_node


@dataclass(frozen=True)
class Placement:
    """The nodes a job of one component uses (in the allocation's order), ``tasks_per_node``
    trainers on each; ``narrowed`` when they are fewer than the allocation's nodes, so that
    the steps must name them."""

    nodes: Tuple[str, ...]
    tasks_per_node: int
    narrowed: bool

    def step_options(self, tasks_per_node=None):
        """srun's options that put a step on these nodes, ``tasks_per_node`` tasks on each
        (default: the trainers'); none when the step spans the whole allocation."""
        if not self.narrowed:
            return []
        per_node = self.tasks_per_node if tasks_per_node is None else tasks_per_node
        return [f"--nodes={len(self.nodes)}", f"--ntasks={len(self.nodes) * per_node}",
                f"--ntasks-per-node={per_node}", f"--nodelist={','.join(self.nodes)}"]


def tasks_per_node(env):
    """The trainers per node of a job of one component: SLURM_NTASKS_PER_NODE
    (``--ntasks-per-node``), else SLURM_TASKS_PER_NODE when it is the same on every node."""
    explicit = env.get("SLURM_NTASKS_PER_NODE")
    if explicit and explicit.isdigit():
        return int(explicit)
    counts = set(expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "")))
    if len(counts) != 1:
        raise ConfigError(f"EDDIS_SPARE_NODES needs the same number of tasks on every node, and this job "
                          f"has SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r}: submit it with "
                          "--ntasks-per-node (eddis submit does)")
    return counts.pop()


def allocation_nodes(env):
    """The nodes Slurm gave the job when it started (SLURM_JOB_NODELIST), in order."""
    return tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")))


def plan(nodes: Sequence[str], spare: int, per_node: Optional[int], failed=(),
         batch_host: Optional[str] = None) -> Placement:
    """The nodes to use: ``len(nodes) - spare`` healthy ones, the batch host last (see the module
    docstring). ``failed``: node names, or ``{name: why}`` (:func:`failed_nodes`). Raises
    :class:`NodeFailureError` naming the failed nodes when too few remain."""
    nodes = tuple(nodes)
    if spare < 0 or spare >= len(nodes):
        raise ConfigError(f"EDDIS_SPARE_NODES={spare}, but the job holds {len(nodes)} node(s) "
                          f"({','.join(nodes)}): the trainers need at least one. Submit with more nodes "
                          "(eddis submit --spare-nodes K adds them) or lower EDDIS_SPARE_NODES")
    needed = len(nodes) - spare
    healthy = [n for n in nodes if n not in failed]
    if len(healthy) < needed:
        why = failed.values() if isinstance(failed, Mapping) else failed
        raise NodeFailureError(too_few_message("; ".join(why), healthy, needed))
    chosen = set(sorted(healthy, key=lambda n: n == batch_host)[:needed])
    return Placement(tuple(n for n in nodes if n in chosen), per_node, narrowed=needed < len(nodes))


def too_few_message(failed, healthy, needed):
    """What the job says when too few healthy nodes remain for a restart, and the fixes."""
    return (f"node(s) {failed} of this job failed, and its trainers need "
            f"{needed} node(s) where {len(healthy)} healthy one(s) remain"
            f"{' (' + ', '.join(healthy) + ')' if healthy else ''}: not restarted. Fixes: submit with spare "
            "nodes (eddis submit --spare-nodes K, one GPU type, which adds K nodes and #SBATCH --no-kill, so that Slurm "
            "keeps the job when a node fails and the restart leaves that node out); or, for a sync run on "
            "a fixed global batch (eddis.BalancedBatchSampler / balanced_slice), resume the last "
            "checkpoint in a new job on fewer nodes, which eddis.resume() allows")


def spares_without_no_kill(spares, no_kill):
    """The loud warning of a job that holds spare nodes but did not ask for ``--no-kill``
    (``no_kill``: :func:`eddis.slurm.nodes.job_no_kill`, None when unknown), or None: without
    it Slurm ends the whole job when one of its nodes fails, so no restart ever uses a spare."""
    if not spares or no_kill:
        return None
    spare = len(spares)
    fix = ("add `#SBATCH --no-kill` to the job script (eddis submit --spare-nodes K writes it), or unset "
           "EDDIS_SPARE_NODES and use the node(s) for training")
    if no_kill is None:
        return (f"WARNING: EDDIS_SPARE_NODES={spare}, and Slurm could not show this job's batch script to "
                f"tell whether it asked for --no-kill (scontrol write batch_script failed). Without "
                f"--no-kill Slurm ends the whole job when one of its nodes fails, and the spare node(s) "
                f"{','.join(spares)} are never used: {fix}")
    return (f"WARNING: EDDIS_SPARE_NODES={spare}, but this job did not ask for --no-kill (no `#SBATCH "
            f"--no-kill` in its script, no SBATCH_NO_KILL): Slurm ends the whole job when one of its nodes "
            f"fails, so the spare node(s) {','.join(spares)} are never used and the restart "
            f"(EDDIS_MAX_RESTARTS) never comes. Fix: {fix}. A --no-kill given on sbatch's command line is "
            "invisible to the job (Slurm 22.05 does not show it); if you gave one, put it in the script "
            "instead to silence this warning")


def failed_nodes(started: Sequence[str], current: Optional[Sequence[str]],
                 health: Optional[Mapping[str, object]]):
    """The nodes of the allocation that failed: in a failed state (``health``: name ->
    :class:`eddis.slurm.nodes.NodeHealth`), or no longer in the job's node list (``current``),
    which is what Slurm does to a ``--no-kill`` job's failed node.
    ``{name: "n2 (DOWN: reason; removed from the job)"}``."""
    found = {}
    for name in started:
        node = (health or {}).get(name)
        why = [node.condition()] if node is not None and node.failed else []
        if current is not None and name not in current:
            why.append("removed from the job")
        if why:
            found[name] = f"{name} ({'; '.join(why)})"
    return found


def first_placement(nodes, parts, env, batch_host=None):
    """Where a job's steps run at first: every node (None), or all but EDDIS_SPARE_NODES of
    ``nodes``; ``parts``: the job's hetjob components (a job of one only may hold spares)."""
    from .. import settings

    spare = settings.get("EDDIS_SPARE_NODES")
    if not spare:
        return None
    if len(parts) > 1:
        raise ConfigError(f"EDDIS_SPARE_NODES={spare} is for a job of one component, and this hetjob "
                          f"has {len(parts)}: each component's trainers use all its nodes. "
                          "Unset EDDIS_SPARE_NODES, or submit one GPU type with spare nodes")
    return plan(nodes, spare, tasks_per_node(env), batch_host=batch_host)


def without_failed_nodes(job_id, started, current, batch_host, say):
    """Ask Slurm which of the job's nodes (``started``) failed, and plan its next attempt without
    them: ``(placement, True)``, the ``current`` one when none failed or Slurm cannot tell;
    ``(current, False)`` when too few healthy nodes remain. ``say`` takes what the job tells."""
    from .. import settings
    from ..slurm.nodes import job_node_lists, node_health

    if not started:
        return current, True
    lists = job_node_lists(job_id)
    health = node_health(",".join(started))
    if lists is None or health is None:
        say("Slurm did not say which of the job's nodes are healthy (scontrol show job/node failed); the "
            "restart uses the same nodes")
        return current, True
    failed = failed_nodes(started, {n for text in lists for n in expand_hostlist(text)}, health)
    if not failed:
        return current, True
    try:
        chosen = plan(started, settings.get("EDDIS_SPARE_NODES"), None if current is None else current.tasks_per_node,
                      failed, batch_host)
    except NodeFailureError as exc:
        say(f"error: {exc}")
        return current, False
    say(f"node(s) {'; '.join(failed.values())} failed: the smb-servers and trainers restart on "
        f"{','.join(chosen.nodes)}, without {', '.join(failed)}")
    return chosen, True
