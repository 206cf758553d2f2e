"""Every mode on one cluster and model, and the recommendation (docs/plan.md, "Recommendation").

``evaluate(cluster, workload)`` gives, per mode, the model's :class:`~.timing.Step` with
its share of the ideal, its ratio to the ring, and, where the samples to the target are
known, the time to it: modes of one big batch need ``samples_to_target`` samples, an
elastic mode ``samples_to_target / sample_efficiency[mode]`` (its efficiency measured,
never assumed). ``recommend`` picks the EDDIS mode that reaches the target first, with
its batch split, its tau and its wire format.
"""
from dataclasses import dataclass, replace
from typing import Optional

from . import timing
from .modes import LISTED, MODES, RING, SOLO

DEFAULT_TAU = 4          # EDDIS_EASGD_TAU's default
TAUS = (1, 2, 4, 8, 16, 32)
TAU_HIDDEN = 0.95        # a tau "hides" the exchanges when hybrid keeps this share of its no-exchange speed
COMPRESSION_GAIN = 1.05  # fp16/bf16 is advised when it is this much faster than fp32
TIE = 0.005              # modes this close in speed are a tie, broken by PREFERENCE
PREFERENCE = ["eddis-sync", "eddis-balanced", "eddis-hybrid", "eddis-hybrid-balanced", "eddis-easgd",
              "eddis-allreduce", "eddis-sync-flat"]


@dataclass
class Outcome:
    step: timing.Step
    x_ideal: float
    x_ring: Optional[float]
    efficiency: Optional[float]         # samples to target of one big batch over the mode's
    samples_to_target: Optional[float]
    time_to_target_s: Optional[float]

    @property
    def effective_samples_per_s(self):
        """samples/s x sample efficiency: what orders the modes by time to the target."""
        return None if self.efficiency is None else self.step.samples_per_s * self.efficiency


def efficiency_of(mode, workload):
    if mode == SOLO:
        return None
    return workload.sample_efficiency.get(mode) if MODES[mode].elastic else 1.0


def step_of(mode, cluster, workload, per_sample, tau=DEFAULT_TAU, overlap=None, run_steps=None):
    if isinstance(mode, str):
        mode = MODES[mode]
    if mode.elastic:
        return timing.elastic_mode(mode, cluster, workload, per_sample, tau, overlap, run_steps)
    return timing.lockstep_mode(mode, cluster, workload, per_sample)


def evaluate(cluster, workload, modes=None, tau=DEFAULT_TAU, overlap=None, run_steps=None):
    """``{mode: Outcome}`` for ``modes`` (default: the listed ones) and the ideal (``solo``)."""
    per_sample = timing.per_sample_times(cluster, workload)
    ideal = timing.solo(cluster, workload, per_sample)
    steps = {SOLO: ideal}
    for name in modes or LISTED:
        steps[name] = step_of(name, cluster, workload, per_sample, tau, overlap, run_steps)
    ring = steps.get(RING)
    out = {}
    for name, step in steps.items():
        eff = efficiency_of(name, workload)
        samples = None if eff is None or workload.samples_to_target is None else workload.samples_to_target / eff
        out[name] = Outcome(step, step.samples_per_s / ideal.samples_per_s,
                            step.samples_per_s / ring.samples_per_s if ring else None, eff, samples,
                            None if samples is None else samples / step.samples_per_s)
    return out


@dataclass
class Recommendation:
    mode: str
    compression: str
    batches: list
    tau: Optional[int]
    outcome: Outcome
    reasons: list


def best_tau(cluster, workload, mode="eddis-hybrid", taus=TAUS):
    """The smallest tau at which the mode keeps TAU_HIDDEN of its speed with no exchanges at
    all (a smaller tau moves the workers closer together, so it needs no more samples)."""
    per_sample = timing.per_sample_times(cluster, workload)
    free = step_of(mode, cluster, workload, per_sample, tau=10 ** 9).samples_per_s
    for tau in taus:
        if step_of(mode, cluster, workload, per_sample, tau=tau).samples_per_s >= TAU_HIDDEN * free:
            return tau
    return taus[-1]


def advise_tau(cluster, workload, mode, tau):
    """(tau, why): the smallest tau that hides the exchanges, unless that is larger than the
    tau the sample efficiency was measured at (a larger one may need more samples)."""
    hidden = best_tau(cluster, workload, mode)
    measured = workload.efficiency_tau
    if measured is not None and hidden > measured:
        return measured, (f"tau {measured}, as its sample efficiency was measured; tau {hidden} would hide the "
                          "exchanges, if the efficiency held there (measure it)")
    return hidden, (f"tau {hidden}: the smallest tau at which {mode} keeps {TAU_HIDDEN:.0%} of its speed with "
                    f"no exchanges" + (f" (at or below the tau {measured} its efficiency was measured at: "
                                       "no more samples)" if measured is not None else
                                       " (its sample efficiency is for the tau it was measured at)"))


def _compressed_twin(mode):
    """The same path with fp16 on the wire, where EDDIS has it (sync in every lockstep form)."""
    m = MODES[mode]
    twinned = ("sync", "hierarchical", "smb-ring", "flat", "mpi")
    return replace(m, name=f"{mode}+fp16", wire=2) if m.path in twinned else None


def recommend(cluster, workload, outcomes, tau=DEFAULT_TAU):
    """The EDDIS mode to run (the ring is the peers', not a choice here): the fastest to the
    target where each mode's sample efficiency is known, its fp16 twin where that is
    ``COMPRESSION_GAIN`` faster, the batch split, and for hybrid the smallest tau that hides
    the exchanges."""
    reasons = []
    known = {m: o for m, o in outcomes.items() if m not in (SOLO, RING) and not MODES[m].name.startswith("ddp")
             and MODES[m].wire == 4 and o.effective_samples_per_s is not None}
    if not known:   # only elastic modes, none with an efficiency: by samples/s, and say so
        known = {m: o for m, o in outcomes.items() if m != SOLO and not m.startswith("ddp")}
        reasons.append("no mode with a known sample efficiency: chosen by samples/s alone")
        best = max(known, key=lambda m: known[m].step.samples_per_s)
    else:
        top = max(o.effective_samples_per_s for o in known.values())
        # within TIE of the fastest, the simpler mode: plain sync before its variants
        near = [m for m, o in known.items() if o.effective_samples_per_s >= (1 - TIE) * top]
        best = min(near, key=lambda m: PREFERENCE.index(m) if m in PREFERENCE else len(PREFERENCE))
    chosen = known[best]
    for m, o in outcomes.items():
        if m in known or m == SOLO or m.startswith("ddp") or not MODES[m].elastic:
            continue
        need = chosen.step.samples_per_s / o.step.samples_per_s
        if need < 1:
            reasons.append(f"{m} runs {o.step.samples_per_s / chosen.step.samples_per_s:.2f}x the samples/s of "
                           f"{best}; it is faster to the target if it needs less than "
                           f"{1 / need:.2f}x sync's samples (give its measured sample_efficiency "
                           "in model.json)")
    choice_tau = None
    if MODES[best].path == "hybrid":
        choice_tau, why = advise_tau(cluster, workload, best, tau)
        reasons.append(why)
    compression = "none"
    twin = _compressed_twin(best)
    if twin is not None:
        per_sample = timing.per_sample_times(cluster, workload)
        faster = timing.lockstep_mode(twin, cluster, workload, per_sample)
        gain = faster.samples_per_s / chosen.step.samples_per_s
        if gain >= COMPRESSION_GAIN:
            compression = "fp16"
            reasons.append(f"fp16 (or bf16) on the wire: {gain:.2f}x the samples/s of fp32 (check that the "
                           "loss follows fp32's)")
        else:
            reasons.append(f"fp32 on the wire: fp16 would give only {gain:.2f}x")
    return Recommendation(best, compression, chosen.step.batches, choice_tau, chosen, reasons)


def describe_split(cluster, batches):
    """'a100 x8: 11 samples, v100 x8: 6 samples' (ranks of one kind and share together)."""
    groups = {}
    for rank, b in zip(cluster.ranks, batches):
        groups.setdefault((rank.kind, b), 0)
        groups[(rank.kind, b)] += 1
    return ", ".join(f"{kind} x{count}: {b} samples" for (kind, b), count in groups.items())

