"""``eddis plan``: a model with written equations of every mode's step, and the mode to run.

No framework here, and nothing above ``smb`` and ``timeline``: the model (:mod:`.timing`,
:mod:`.traffic`) is pure functions of the cluster and the model (:mod:`.spec`, read from
two JSON files); :mod:`.evaluate` compares the modes (:mod:`.modes`) and recommends one;
:mod:`.calibrate` reads a run's profile and timeline, :mod:`.plot` draws. Two modules sit in
the tools layer instead, above core: :mod:`.probe` measures the link, SMB and EDDIS's own
reducers inside a job, and :mod:`.command` is the subcommand. Nothing else here imports
them. docs/plan.md has the equations.
"""
