"""Checksums of a checkpoint's files, and which checkpoint a resume may load.

Writing (:mod:`.save`): every rank seals the files it wrote (:func:`seal`: fsync, then
their size and SHA-256), in parallel; the committing rank seals ``training.h5`` and writes every
file's entry into the manifest, which carries a SHA-256 of its own, before the commit rename.
The hash reads the file back, from the page cache it was just written to, rather than hashing
the writes as they go: h5py writes with seeks (its superblock last), so the stream of its
writes is not the file; read back, the cost is the hash's (docs/reliability.md).

Resuming (:func:`choose`, collective): rank 0 lists the candidates, newest first; for each,
rank 0 reads its manifest and every rank verifies its share of the files (split by bytes), and
the first that verifies on every rank is the one loaded. One that fails is named in the job
output with the file, what its manifest expects and what was found; once an older one is
taken, the failed ones are set aside (``ckpt-N.corrupt``, :func:`eddis.core.checkpoint.folders.set_aside`)
so that keep-last-N and new checkpoints never count them. When none verifies the resume fails
with :class:`~eddis.errors.CheckpointCorruptError`: nothing is loaded and nothing trained, and a
folder whose checkpoints were all set aside is never taken for an empty one (a fresh start).

Elastic commits (:func:`choose_for_name`) are chosen the same way among the checkpoints a
commit wrote, then loaded by name through their adapter's resume, which takes the one chosen
without hashing its files again.

A checkpoint written before EDDIS kept checksums (its manifest has none) cannot be verified:
it is resumed as it is, with a warning, so that a long job goes on across the upgrade; a file
its manifest lists and the folder lacks is still refused.
"""
import hashlib
import heapq
import logging
import os

from ...errors import CheckpointCorruptError, CheckpointError
from ..comm import collectives, runtime
from . import folders as layout

log = logging.getLogger("eddis.core.checkpoint")

ALGORITHM = "sha256"
CHUNK_BYTES = 4 << 20
FIX = "use an older checkpoint, or restore the file from a backup"


def _size_and_digest(f):
    digest = hashlib.new(ALGORITHM)
    size = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    while True:
        n = f.readinto(buffer)
        if not n:
            return size, digest.hexdigest()
        digest.update(view[:n])
        size += n


def seal(path):
    """Make the file at ``path`` durable (fsync) and return its manifest entry:
    ``{"bytes": size, "sha256": hex digest}``."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        size, digest = _size_and_digest(f)
    return {"bytes": size, ALGORITHM: digest}


def seal_all(folder, names):
    """``{name: seal(folder/name)}``."""
    return {name: seal(os.path.join(folder, name)) for name in names}


def entries(folder, manifest):
    """``{file: entry}`` to verify of a checkpoint: every file its manifest lists (none of one
    written before checksums); a CheckpointCorruptError when one lacks its entry."""
    if not layout.has_checksums(manifest):
        return {}
    sums = manifest[layout.CHECKSUMS]
    missing = [name for name in manifest["files"] if name not in sums]
    if missing:
        raise CheckpointCorruptError(f"the manifest of checkpoint {folder} lists {', '.join(missing[:5])} "
                                     "without a checksum: damaged after it was written", FIX)
    return {name: sums[name] for name in manifest["files"]}


def verify_file(folder, name, expected):
    """Check ``folder/name`` against its manifest entry ``expected``; a CheckpointCorruptError
    naming the file, what was expected and what was found when it is missing, of another
    size or of another SHA-256."""
    path = os.path.join(folder, name)
    want = f"{expected['bytes']} bytes, SHA-256 {expected[ALGORITHM]}"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # (a file of another size is not read through)
            digest = _size_and_digest(f)[1] if size == expected["bytes"] else None
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing, its manifest lists it ({want})", FIX) from None
    except OSError as exc:
        raise CheckpointCorruptError(f"cannot read {path} ({exc}), its manifest lists it ({want})", FIX) from None
    if size != expected["bytes"]:
        how = "truncated" if size < expected["bytes"] else "written to"
        raise CheckpointCorruptError(f"{path} has {size} bytes, its manifest says {expected['bytes']}: it was "
                                     f"{how} after the checkpoint was written", FIX)
    if digest != expected[ALGORITHM]:
        raise CheckpointCorruptError(f"{path} has SHA-256 {digest}, its manifest says {expected[ALGORITHM]} "
                                     f"(both {size} bytes): its content changed after the checkpoint was "
                                     "written", FIX)


def verify(folder, manifest, names=None):
    """Check the files ``names`` (None: all) of the checkpoint ``folder`` against ``manifest``."""
    expected = entries(folder, manifest)
    for name in sorted(expected) if names is None else names:
        verify_file(folder, name, expected[name])


def shares(expected, size):
    """The files of ``expected`` (``{file: entry}``) split over ``size`` ranks by bytes, the
    largest first to the least loaded rank: ``[names of rank 0, ...]``, the same on every rank."""
    parts = [[] for _ in range(size)]
    load = [(0, r) for r in range(size)]
    for name in sorted(expected, key=lambda n: (-int(expected[n]["bytes"]), n)):
        done, r = heapq.heappop(load)
        parts[r].append(name)
        heapq.heappush(load, (done + int(expected[name]["bytes"]), r))
    return parts


# ---------------------------------------------------------------- which checkpoint to load
def pick(paths, check):
    """The first of ``paths`` (newest first) that ``check`` (path -> manifest) passes, and those
    it skipped: ``(path, manifest, [(path, reason), ...])``; ``(None, None, skipped)`` when none
    passes. Only a CheckpointCorruptError skips one; any other error ends the choice. A
    ``check`` that returns None passes over a checkpoint the caller does not take (a periodic
    one among elastic commits): not loaded, and not skipped either."""
    skipped = []
    for path in paths:
        try:
            manifest = check(path)
        except CheckpointCorruptError as exc:
            skipped.append((path, exc.problem))
            continue
        if manifest is not None:
            return path, manifest, skipped
    return None, None, skipped


def none_verifies(where, named, skipped):
    """The error of a resume where no checkpoint verifies (nothing was loaded)."""
    reasons = "; ".join(reason for _, reason in skipped[:4])
    if named:
        return CheckpointCorruptError(
            f"checkpoint {where} fails verification, nothing was loaded: {reasons}",
            "restore the file from a backup, or pass the folder that holds the checkpoints to resume "
            "from the newest one that verifies")
    return CheckpointCorruptError(
        f"none of the {len(skipped)} checkpoints in {where} verifies, nothing was loaded and nothing "
        f"trained: {reasons}", "restore the files from a backup, or move the checkpoints away (or set "
        "another EDDIS_CHECKPOINT_DIR) to start afresh")


def _check_together(path, rank, size, wanted=None):
    """Collective: rank 0 reads the manifest of ``path``, every rank verifies its share of the
    files; the manifest, or the same error on every rank; None, unverified, when ``wanted``
    (manifest -> bool) does not take it."""
    manifest = failure = None
    if rank == 0:
        try:
            manifest = layout.read_manifest(path)
        except CheckpointCorruptError as exc:
            failure = (True, exc.problem)
        except CheckpointError as exc:
            failure = (False, str(exc))
    manifest, failure = collectives.broadcast_object((manifest, failure), root=0,
                                                     what=f"resume: the manifest of {path}")
    if failure is None and wanted is not None and not wanted(manifest):
        return None
    if failure is None:
        try:
            expected = entries(path, manifest)
            for name in shares(expected, size)[rank]:
                verify_file(path, name, expected[name])
        except CheckpointCorruptError as exc:
            failure = (True, exc.problem)
        except Exception as exc:   # every rank must hear of it, or the others wait for it
            failure = (False, f"rank {rank}: {type(exc).__name__}: {exc}")
        failed = [f for f in collectives.allgather_object(failure, what=f"resume: verifying {path}") if f]
        failure = None if not failed else (all(corrupt for corrupt, _ in failed),
                                           "; ".join(reason for _, reason in failed[:3]))
    if failure is None:
        return manifest
    corrupt, reason = failure
    raise CheckpointCorruptError(reason, FIX) if corrupt else CheckpointError(reason)


# what choose_for_name chose and verified, {path: manifest}, until the resume by that name
# takes it (every rank holds the same: the choice is collective)
_chosen_for_name = {}


def choose_for_name(directory, wanted, what):
    """Collective: the path of the checkpoint in ``directory`` that a resume by its name is to
    load next (an elastic commit, through its adapter's resume): the newest that ``wanted``
    (manifest -> bool) takes and that verifies, chosen and reported as :func:`choose` does, its
    output naming it a ``what``; None when there is none (a fresh start). That resume takes it
    without hashing its files a second time."""
    found, manifest = choose(directory, wanted, what)
    if found is not None:
        _chosen_for_name[found] = manifest
    return found


def choose(path_or_dir, wanted=None, what="checkpoint"):
    """Collective: ``(path, manifest)`` of the checkpoint a resume loads (see the module
    docstring), or ``(None, None)``: nothing to resume, a fresh start. ``wanted`` (manifest ->
    bool): the checkpoints it may take (None: all); ``what``: their name in the job output."""
    rank, size = runtime.rank(), runtime.size()
    listed = error = None
    if rank == 0:
        try:
            listed = layout.candidates(path_or_dir)
        except CheckpointError as exc:
            error = exc
    listed, error = collectives.broadcast_object((listed, error), root=0, what="resume: finding the checkpoint")
    if error is not None:
        raise error
    paths, named = listed
    if named and paths[0] in _chosen_for_name:
        return paths[0], _chosen_for_name.pop(paths[0])
    found, manifest, skipped = pick(paths, lambda path: _check_together(path, rank, size, wanted))
    if found is None and skipped:
        raise none_verifies(paths[0] if named else os.fspath(path_or_dir), named, skipped)
    if rank == 0:
        _report(found, manifest, skipped, what)
    return found, manifest


def _report(found, manifest, skipped, what):
    """Rank 0, in the job output: what was skipped and why, and what is loaded instead."""
    for path, reason in skipped:
        try:
            aside = layout.set_aside(path)
        except OSError as exc:
            aside = f"left in place, it could not be renamed ({exc})"
        else:
            aside = f"set aside as {os.path.basename(aside)}"
        log.warning("checkpoint %s fails verification, skipped (%s): %s", path, aside, reason)
    if skipped:
        log.warning("resuming from %s (step %d), the newest %s that verifies", found, manifest["step"], what)
    if found is not None and not layout.has_checksums(manifest):
        log.warning("checkpoint %s was written before EDDIS kept checksums (by EDDIS %s): its files cannot "
                    "be verified and are loaded as they are; the checkpoints this run writes carry them",
                    found, manifest.get("eddis_version", "?"))
