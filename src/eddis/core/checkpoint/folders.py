"""Checkpoint folders on disk: names, manifest, atomic commit, the latest complete one, keep-last-N,
the interval setting and the signal-safe request flag. Framework-free and collective-free.

A checkpoint is one folder; it counts as complete only under its final name, which only a
rename gives it, and only after every rank's files and the manifest (written last) are in::

    <dir>/ckpt-00001200/            complete: step 1200
        manifest.json               format, EDDIS version, world size, mode, step, settings, files,
                                    each file's size and SHA-256, and its own SHA-256
        training.h5                 the SMB state (centre, counter values, balance shares, ...)
        rank-00000.h5               rank 0's RNG states and data position (core)
        rank-00000.pt               rank 0's model, optimizer and framework RNG (adapter's format)
        ...
    <dir>/.ckpt-00001300.tmp-<id>/  being written (or left by a crash): never read, removed later
    <dir>/ckpt-00001400.corrupt/    failed its checksums at a resume that took an older one:
                                    set aside, never read nor removed by EDDIS

Every file is fsynced before the commit rename, the folder too, and the parent after it, so
a crash or power loss leaves either the previous checkpoints or this one, complete on disk.

``request(reason)`` only sets a flag, so a signal handler may call it; the runtime reads
it at the next step boundary (:mod:`eddis.core.checkpoint.schedule`).
"""
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid

from ... import __version__, settings
from ...errors import CheckpointCorruptError, CheckpointError
from ...smb import rundir

FORMAT = 1
MANIFEST = "manifest.json"
TRAINING_STATE = "training.h5"
PREFIX = "ckpt-"
TMP_PREFIX = ".ckpt-"
CORRUPT_SUFFIX = ".corrupt"
MANIFEST_CHECKSUM = "manifest_sha256"   # of the manifest's other entries (manifest_digest)
CHECKSUMS = "checksums"                 # {file: {"bytes": n, "sha256": hex}}
_COMPLETE = re.compile(r"^ckpt-(\d+)$")
_TEMPORARY = re.compile(r"^\.ckpt-(\d+)\.tmp-")
_SET_ASIDE = re.compile(r"^ckpt-(\d+)\.corrupt")


def folder_name(step):
    return f"{PREFIX}{int(step):08d}"


def temporary_name(step, token):
    return f"{TMP_PREFIX}{int(step):08d}.tmp-{token}"


def rank_file(rank, ext):
    return f"rank-{int(rank):05d}{ext}"


# ---------------------------------------------------------------- the manifest
def make_manifest(*, framework, world_size, mode, step, epoch, batch, global_step, settings_used,
                  files, extra=None, reason="explicit", per_rank=None, ranks=None, checksums=None):
    """The manifest of one checkpoint (a dict, written as JSON); ``files``: names in the folder;
    ``ranks``: the ranks whose state it holds (None: all ``world_size``), the others were lost
    before it (an elastic run); ``checksums``: each file's size and SHA-256
    (:func:`eddis.core.checkpoint.verify.seal`)."""
    ranks = list(range(int(world_size))) if ranks is None else sorted(int(r) for r in ranks)
    return {"format": FORMAT, "eddis_version": __version__, "framework": framework,
            "world_size": int(world_size), "mode": mode, "step": int(step), "epoch": int(epoch),
            "batch": int(batch), "global_step": int(global_step), "settings": dict(settings_used),
            "files": sorted(files), "extra": dict(extra or {}), "reason": reason,
            "per_rank": list(per_rank or []), "ranks": ranks,
            "lost_ranks": sorted(set(range(int(world_size))) - set(ranks)), "written_at": time.time(),
            CHECKSUMS: dict(checksums or {})}


def manifest_digest(manifest):
    """The SHA-256 of a manifest's entries but its own checksum, in one canonical JSON form, so
    that a byte changed in manifest.json is found even where the JSON still parses."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def has_checksums(manifest):
    """Whether a manifest carries checksums: every one EDDIS writes since they were added (one
    written before has neither its own nor its files', and resumes unverified, with a warning)."""
    return MANIFEST_CHECKSUM in manifest or CHECKSUMS in manifest


def ranks_held(manifest):
    """The ranks whose files a checkpoint holds: all of its world size, unless ranks were lost
    before it (manifests before elastic checkpoints name none)."""
    return list(manifest.get("ranks", range(int(manifest["world_size"]))))


def lost_ranks(manifest):
    """The ranks of the run that wrote a checkpoint that were lost before it (elastic runs)."""
    return list(manifest.get("lost_ranks", []))


def write_manifest(folder, manifest):
    """Write the manifest durably (it is what marks the folder's content as written)."""
    path = os.path.join(folder, MANIFEST)
    try:
        manifest = {**manifest, MANIFEST_CHECKSUM: manifest_digest(manifest)}
        text = json.dumps(manifest, indent=1, sort_keys=True)
    except TypeError as exc:
        raise CheckpointError(f"the checkpoint's extra values must be JSON values (numbers, strings, "
                              f"lists, dicts): {exc}. Pass plain numbers, or save tensors yourself.") from None
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder):
    """The manifest of a complete checkpoint folder, checked; a CheckpointError otherwise."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a checkpoint: it has no {MANIFEST}. Pass a folder "
                              "eddis.checkpoint() wrote, or the folder that holds them.") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"cannot read {path} ({exc})", "make it readable, or use an older "
                                     "checkpoint") from None
    except ValueError as exc:   # a complete folder's manifest was written whole
        raise CheckpointCorruptError(f"{path} is not JSON ({exc}): damaged after the checkpoint was "
                                     "written", "use an older checkpoint") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorruptError(f"{path} holds {type(manifest).__name__}, not a manifest: damaged "
                                     "after the checkpoint was written", "use an older checkpoint")
    if has_checksums(manifest):
        expected, found = manifest.get(MANIFEST_CHECKSUM), manifest_digest(manifest)
        if expected != found or not isinstance(manifest.get(CHECKSUMS), dict):
            raise CheckpointCorruptError(
                f"{path} has SHA-256 {found} over its entries, it says {expected}: the manifest was "
                "changed after the checkpoint was written", "use an older checkpoint")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {manifest.get('format')!r} where this EDDIS "
                              f"({__version__}) reads format {FORMAT}")
    missing = [name for name in manifest.get("files", ()) if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise CheckpointCorruptError(
            f"checkpoint {folder} lacks {', '.join(missing[:5])}, which its manifest lists: the folder "
            "was changed after it was written", "use an older checkpoint, or restore the file from a backup")
    return manifest


# ---------------------------------------------------------------- finding and pruning
def complete_checkpoints(directory):
    """``[(step, path)]`` of the complete checkpoints in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _COMPLETE.match(name)
        if match and os.path.isfile(os.path.join(directory, name, MANIFEST)):
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest(directory):
    """The newest complete checkpoint folder in ``directory``, or None."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def set_aside_checkpoints(directory):
    """The names of the checkpoints in ``directory`` that a resume set aside as corrupt."""
    try:
        return sorted(name for name in os.listdir(directory) if _SET_ASIDE.match(name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def set_aside(folder):
    """Rename the complete checkpoint ``folder`` that failed its checksums to
    ``<folder>.corrupt`` (kept for inspection: a rename back restores it), so that it neither
    counts among the newest EDDIS_CHECKPOINT_KEEP (the good ones written after it would be
    pruned first) nor sorts above them; returns the new path."""
    target = folder + CORRUPT_SUFFIX
    if os.path.exists(target):
        target = f"{target}-{uuid.uuid4().hex[:8]}"
    os.rename(folder, target)
    _fsync_dir(os.path.dirname(folder) or ".")
    return target


def candidates(path_or_dir):
    """What a resume of ``path_or_dir`` may load: ``([folder], True)`` when it names a checkpoint
    itself, else ``(its complete checkpoints, newest first, False)``; ``([], False)``: nothing
    to resume, a fresh start. A folder whose every checkpoint was set aside as corrupt is no
    fresh start: a CheckpointCorruptError."""
    path = os.fspath(path_or_dir)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return [path], True
    if os.path.basename(os.path.normpath(path)).startswith(TMP_PREFIX):
        raise CheckpointError(f"{path} is a checkpoint that was never completed (its writer stopped "
                              "before the commit); pass the folder that holds the checkpoints instead")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint folder: pass a folder "
                              "eddis.checkpoint() wrote, or the folder that holds them")
    found = [folder for _, folder in reversed(complete_checkpoints(path))]
    aside = set_aside_checkpoints(path)
    if not found and aside:
        raise CheckpointCorruptError(
            f"every checkpoint in {path} failed its checksums at an earlier resume and was set aside "
            f"({', '.join(aside[:4])}): nothing verifies to resume from, and nothing was trained",
            "restore them from a backup (and rename one back to ckpt-N), or remove them (or set another "
            "EDDIS_CHECKPOINT_DIR) to start afresh")
    return found, False


def resolve(path_or_dir):
    """The checkpoint folder ``path_or_dir`` names: itself when it holds a manifest, else the
    newest complete checkpoint in it, else None (nothing to resume: a fresh start). Unverified:
    a resume takes the newest that verifies (:func:`eddis.core.checkpoint.verify.choose`)."""
    found, _ = candidates(path_or_dir)
    return found[0] if found else None


def prune(directory, keep):
    """Remove all but the newest ``keep`` complete checkpoints (``keep`` 0: remove none) and the
    temporary folders of uncompleted ones older than the newest complete one. Returns the
    removed paths."""
    found = complete_checkpoints(directory)
    removed = []
    if keep > 0:
        for _, path in found[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    newest = found[-1][0] if found else None
    if newest is not None:
        for name in os.listdir(directory):
            match = _TEMPORARY.match(name)
            if match and int(match.group(1)) <= newest:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(os.path.join(directory, name))
    return removed


def number_for(directory, step, after_newest):
    """The number of a new checkpoint's folder in ``directory``: ``step``; with ``after_newest``
    one above the newest complete checkpoint's when ``step`` is lower, so that the newest folder
    stays the one written last (easgd/hybrid, where the step is one worker's: a run resumed on
    another number of workers starts at step 0, and after rank 0 was lost another rank, with
    other steps, commits)."""
    step = int(step)
    found = complete_checkpoints(directory) if after_newest else []
    newest = found[-1][0] if found else None
    return newest + 1 if newest is not None and step < newest else step


def commit(tmp_folder, final_folder):
    """Give a fully written folder its final name (atomic on one file system). A checkpoint of
    the same step already there (a periodic one, then the loop's own) is replaced; until the
    new one is in, the older checkpoints are the complete ones."""
    _fsync_dir(tmp_folder)   # its entries are on disk before its name says it is complete
    old = None
    if os.path.exists(final_folder):
        old = tmp_folder + "-replaced"
        os.rename(final_folder, old)
    os.rename(tmp_folder, final_folder)
    _fsync_dir(os.path.dirname(final_folder) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the interval setting
def interval_from_settings():
    """EDDIS_CHECKPOINT_INTERVAL: None, ``("steps", n)`` or ``("seconds", s)``."""
    return settings.get("EDDIS_CHECKPOINT_INTERVAL")


# ---------------------------------------------------------------- the request flag
_requested = []   # reasons; appending is atomic, so a signal handler may do it
_sigterm_seen = []   # not cleared with the requests: a later SIGTERM ends the process


def request(reason="requested"):
    """Ask for a checkpoint into EDDIS_CHECKPOINT_DIR and a stop at the next step boundary
    (signal-safe: it only records ``reason``). Every rank then writes the checkpoint at the
    same step and raises :class:`eddis.errors.CheckpointStop` (exit status 75)."""
    _requested.append(str(reason))


def pending_request():
    """The first reason of an unhandled request, or None."""
    return _requested[0] if _requested else None


def clear_request():
    del _requested[:]


def request_from_run_dir():
    """Take up the job's request left in the run directory (the launcher's answer to Slurm's
    warning that came before this rank could listen); call after the handler is installed."""
    run_dir = settings.get("EDDIS_RUN_DIR")
    reason = None if run_dir is None else rundir.checkpoint_request(run_dir)
    if reason is not None:
        request(reason)
    return reason


def requested_by_sigterm():
    """Whether SIGTERM asked for a checkpoint (see :func:`install_signal_handler`)."""
    return bool(_sigterm_seen)


def answer_request(path, step, terminated=False):
    """Rank 0, after the requested checkpoint is complete: tell the job (eddis-train --job or
    --local) that the trainers stop to be requeued, not because training is over, and whether
    SIGTERM asked for it (the job then asks Slurm whether that was a preemption)."""
    run_dir = settings.get("EDDIS_RUN_DIR")
    if run_dir is not None and os.path.isdir(run_dir):
        rundir.answer_checkpoint_request(run_dir, path, step, terminated)


def answer_training_complete(step):
    """A rank whose requested checkpoint came after training had ended elsewhere: tell the job
    that the trainers exit because training is over (no checkpoint, no requeue)."""
    run_dir = settings.get("EDDIS_RUN_DIR")
    if run_dir is not None and os.path.isdir(run_dir):
        rundir.answer_training_complete(run_dir, step)


def _on_signal(signum, frame):
    request(f"signal {signal.Signals(signum).name}")


def _on_term(signum, frame):
    # The first SIGTERM is Slurm's notice (preemption with a GraceTime): checkpoint at the next
    # step boundary. A second one is the order to go (the grace is over, or eddis-train stops
    # this trainer), with SIGTERM's own effect.
    if _sigterm_seen:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _sigterm_seen.append(True)
    request("signal SIGTERM")


def install_signal_handler(signum=signal.SIGUSR1):
    """Make ``signum`` a checkpoint-and-stop request (main thread only; returns whether it did).
    SIGTERM is one only once: a second SIGTERM ends the process."""
    try:
        signal.signal(signum, _on_term if signum == signal.SIGTERM else _on_signal)
    except ValueError:  # not the main thread: a handler cannot be installed from here
        return False
    return True


def ignore_signal_requests(signum=signal.SIGUSR1):
    """After training (eddis.shutdown) no request can be taken any more, and Python's exit puts
    a signal handled in Python back to its default action, which for SIGUSR1 kills the process:
    Slurm's warning arriving as the last run ends would fail a finished job. Ignore ``signum``
    instead (SIG_IGN outlives the interpreter's finalization); a handler not ours is kept.
    Returns whether it did."""
    try:
        if signal.getsignal(signum) is not _on_signal:
            return False
        signal.signal(signum, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return False
    return True
