"""The pure parts of a checkpoint's checksums: sealing files, verifying them (a flipped byte,
a truncated file, a missing one, a changed manifest), the choice of the newest checkpoint that
verifies, the corrupt ones set aside, the split of the files over the ranks and the order of the
fsyncs and the commit rename. A resume through the launcher is in
tests/test_checkpoint_corrupt.py."""
import hashlib
import json
import os

import pytest

from eddis.core.checkpoint import folders as layout
from eddis.core.checkpoint import verify
from eddis.errors import CheckpointCorruptError, CheckpointError

FILES = {"rank-00000.h5": 3000, "rank-00000.pt": 70000, "rank-00001.h5": 3000, "training.h5": 500}


def write_checkpoint(root, step, files=FILES, checksums=True):
    """A complete checkpoint folder of random files of the given sizes, sealed as a run seals
    them (checksums=False: a manifest as EDDIS wrote them before it kept checksums)."""
    folder = root / layout.folder_name(step)
    folder.mkdir(parents=True)
    for name, size in files.items():
        (folder / name).write_bytes(os.urandom(size))
    manifest = layout.make_manifest(framework="torch", world_size=2, mode="sync", step=step, epoch=0,
                                    batch=step, global_step=step, settings_used={}, files=list(files),
                                    checksums=verify.seal_all(str(folder), files) if checksums else None)
    if checksums:
        layout.write_manifest(str(folder), manifest)
    else:
        del manifest[layout.CHECKSUMS]
        (folder / layout.MANIFEST).write_text(json.dumps(manifest))
    return folder


def flip(path, offset=100, count=1):
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


DAMAGE = {
    "flipped": (lambda folder: flip(folder / "rank-00000.pt", 5000, 64),
                r"rank-00000.pt has SHA-256 [0-9a-f]{64}, its manifest says [0-9a-f]{64} \(both 70000 bytes\)"),
    "truncated": (lambda folder: truncate(folder / "rank-00001.h5"),
                  r"rank-00001.h5 has 1500 bytes, its manifest says 3000: it was truncated"),
    "missing": (lambda folder: (folder / "training.h5").unlink(),
                r"lacks training.h5, which its manifest lists"),
}


def check(path):
    manifest = layout.read_manifest(path)
    verify.verify(path, manifest)
    return manifest


def test_seal_gives_the_size_and_sha256_of_the_file(tmp_path):
    data = os.urandom(verify.CHUNK_BYTES + 12345)   # more than one chunk
    (tmp_path / "f").write_bytes(data)
    assert verify.seal(str(tmp_path / "f")) == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "empty").write_bytes(b"")
    assert verify.seal(str(tmp_path / "empty")) == {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}


def test_a_sealed_checkpoint_verifies(tmp_path):
    folder = write_checkpoint(tmp_path, 4)
    manifest = check(str(folder))
    assert set(manifest[layout.CHECKSUMS]) == set(FILES) and manifest[layout.MANIFEST_CHECKSUM]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_refused_naming_it_what_was_expected_and_found(tmp_path, damage):
    folder = write_checkpoint(tmp_path, 4)
    harm, message = DAMAGE[damage]
    harm(folder)
    with pytest.raises(CheckpointCorruptError, match=message) as caught:
        check(str(folder))
    assert "use an older checkpoint" in str(caught.value) and isinstance(caught.value, CheckpointError)
    assert "cannot read" not in str(caught.value)   # a readable file is named for what it holds
    assert str(folder) in caught.value.problem and "; use an older" not in caught.value.problem


def test_a_file_gone_between_the_manifest_and_its_check_is_named_as_missing(tmp_path):
    folder = write_checkpoint(tmp_path, 4)
    manifest = layout.read_manifest(str(folder))
    (folder / "rank-00000.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000.pt is missing, its manifest lists it "
                                                     r"\(70000 bytes, SHA-256 [0-9a-f]{64}\)"):
        verify.verify(str(folder), manifest)


def test_a_changed_manifest_is_refused_even_where_its_json_still_parses(tmp_path):
    folder = write_checkpoint(tmp_path, 4)
    path = folder / layout.MANIFEST
    text = path.read_text()
    path.write_text(text.replace('"step": 4', '"step": 5'))
    with pytest.raises(CheckpointCorruptError, match="the manifest was changed after"):
        layout.read_manifest(str(folder))
    path.write_text(text[:len(text) // 2])
    with pytest.raises(CheckpointCorruptError, match="is not JSON"):
        layout.read_manifest(str(folder))
    # a file's checksum dropped from a manifest whose own checksum is right: never taken unverified
    manifest = json.loads(text)
    del manifest[layout.CHECKSUMS]["training.h5"]
    layout.write_manifest(str(folder), manifest)
    with pytest.raises(CheckpointCorruptError, match="lists training.h5 without a checksum"):
        check(str(folder))


def test_a_checkpoint_written_before_checksums_resumes_unverified_but_whole(tmp_path):
    folder = write_checkpoint(tmp_path, 4, checksums=False)
    flip(folder / "rank-00000.pt")
    manifest = check(str(folder))           # cannot be verified: accepted as it is
    assert not layout.has_checksums(manifest) and verify.entries(str(folder), manifest) == {}
    (folder / "training.h5").unlink()       # a missing file is still found
    with pytest.raises(CheckpointCorruptError, match="lacks training.h5"):
        check(str(folder))


def test_the_files_are_split_over_the_ranks_by_bytes_the_same_everywhere():
    expected = {name: {"bytes": size} for name, size in FILES.items()}
    parts = verify.shares(expected, 2)
    assert parts == [["rank-00000.pt"], ["rank-00000.h5", "rank-00001.h5", "training.h5"]]
    assert verify.shares(expected, 1) == [sorted(FILES, key=lambda n: (-FILES[n], n))]
    many = verify.shares(expected, 6)
    assert sorted(sum(many, [])) == sorted(FILES) and many[4:] == [[], []]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_the_newest_that_verifies_is_chosen_and_the_damaged_ones_named(tmp_path, damage):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    DAMAGE[damage][0](tmp_path / layout.folder_name(6))
    paths, named = layout.candidates(str(tmp_path))
    assert not named and [os.path.basename(p) for p in paths] == ["ckpt-00000006", "ckpt-00000004", "ckpt-00000002"]
    found, manifest, skipped = verify.pick(paths, check)
    assert found == str(tmp_path / "ckpt-00000004") and manifest["step"] == 4
    assert [os.path.basename(p) for p, _ in skipped] == ["ckpt-00000006"]


def test_with_none_that_verifies_nothing_is_chosen_and_the_error_names_each(tmp_path):
    for step, damage in ((2, "flipped"), (4, "truncated"), (6, "missing")):
        DAMAGE[damage][0](write_checkpoint(tmp_path, step))
    paths, named = layout.candidates(str(tmp_path))
    found, manifest, skipped = verify.pick(paths, check)
    assert found is None and manifest is None and len(skipped) == 3
    error = verify.none_verifies(str(tmp_path), named, skipped)
    assert isinstance(error, CheckpointCorruptError)
    text = str(error)
    assert "none of the 3 checkpoints" in text and "nothing was loaded and nothing trained" in text
    assert "ckpt-00000006 lacks training.h5" in text and "ckpt-00000004/rank-00001.h5 has 1500 bytes" in text
    assert "ckpt-00000002/rank-00000.pt has SHA-256" in text
    assert "to start afresh" in text


def test_a_named_checkpoint_that_fails_is_refused_without_falling_back(tmp_path):
    write_checkpoint(tmp_path, 2)
    folder = write_checkpoint(tmp_path, 4)
    flip(folder / "training.h5")
    paths, named = layout.candidates(str(folder))
    assert named and paths == [str(folder)]
    found, _, skipped = verify.pick(paths, check)
    assert found is None
    text = str(verify.none_verifies(str(folder), named, skipped))
    assert "fails verification, nothing was loaded" in text and "pass the folder that holds" in text


def test_only_a_corrupt_checkpoint_is_skipped_any_other_error_ends_the_choice(tmp_path):
    def foreign(path):
        raise CheckpointError("was trained in mode 'easgd'")
    with pytest.raises(CheckpointError, match="mode 'easgd'"):
        verify.pick([str(tmp_path / "a"), str(tmp_path / "b")], foreign)


def test_a_set_aside_checkpoint_neither_counts_nor_is_pruned_and_never_makes_a_fresh_start(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    aside = layout.set_aside(str(tmp_path / "ckpt-00000006"))
    assert os.path.basename(aside) == "ckpt-00000006.corrupt"
    assert [s for s, _ in layout.complete_checkpoints(str(tmp_path))] == [2, 4]
    assert layout.number_for(str(tmp_path), 5, after_newest=True) == 5   # counts below the set-aside 6
    layout.prune(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004", "ckpt-00000006.corrupt"]
    # the same step again: a second name, nothing overwritten
    write_checkpoint(tmp_path, 6)
    assert os.path.basename(layout.set_aside(str(tmp_path / "ckpt-00000006"))).startswith("ckpt-00000006.corrupt-")
    assert layout.resolve(str(tmp_path)) == str(tmp_path / "ckpt-00000004")
    layout.set_aside(str(tmp_path / "ckpt-00000004"))
    with pytest.raises(CheckpointCorruptError, match=r"every checkpoint in .* was set aside .*ckpt-00000004\.corrupt"):
        layout.candidates(str(tmp_path))
    assert layout.candidates(str(tmp_path / "elsewhere")) == ([], False)   # a fresh start


def test_every_file_is_fsynced_before_the_commit_rename_and_the_parent_after_it(tmp_path, monkeypatch):
    """The order of the system calls that make a checkpoint durable, recorded as they are made."""
    calls = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        calls.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def rename(src, dst):
        calls.append(("rename", os.path.basename(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    tmp = tmp_path / layout.temporary_name(8, "t")
    tmp.mkdir()
    for name in FILES:
        (tmp / name).write_bytes(b"x" * 10)
    sums = verify.seal_all(str(tmp), FILES)
    manifest = layout.make_manifest(framework="torch", world_size=2, mode="sync", step=8, epoch=0, batch=8,
                                    global_step=8, settings_used={}, files=list(FILES), checksums=sums)
    layout.write_manifest(str(tmp), manifest)
    layout.commit(str(tmp), str(tmp_path / layout.folder_name(8)))
    rename_at = calls.index(("rename", "ckpt-00000008"))
    before = {name for op, name in calls[:rename_at] if op == "fsync"}
    assert set(FILES) | {layout.MANIFEST, tmp.name} <= before
    assert calls[rename_at + 1:] == [("fsync", tmp_path.name)]
    check(str(tmp_path / "ckpt-00000008"))
