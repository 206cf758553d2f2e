"""Whether a training command can start, checked before anything is started for it.

``eddis-train`` (every launch, and ``--check``/``--job`` in a job script) and ``eddis
submit`` (before ``sbatch``) ask the same question, so a job is never queued, nor its
servers started, only to find that its script is not there.
"""
import os
import shutil


def missing_script(script):
    """Why the training command cannot start (a sentence), or None. Only what can be known
    without running it: a .py file that is not there, a program that is not on PATH."""
    if not script:
        return None
    first = script[0]
    if first == "-m":
        return None if len(script) > 1 else "-m needs a module name"
    if first.endswith(".py") or os.sep in first:
        if not os.path.isfile(first):
            return f"the training script {first} does not exist (working directory {os.getcwd()})"
        return None
    if shutil.which(first) is None:
        return f"the training command {first} is not a file and not on PATH"
    return None
