"""A damaged checkpoint is never resumed, on real ranks (eddis-train --local, real smb-servers,
torch CPU; TensorFlow's files take the same path, checked once).

Stated figures: a sync run of 2 ranks with checkpoints every 2 steps writes, in every manifest,
the size and SHA-256 of each of its files. With 64 bytes flipped in the newest checkpoint's
rank-00000.pt, half of rank-00001.h5 cut off, or training.h5 removed, a resume of that folder
takes the checkpoint before it (step 4, not 6), says in the job output which one it skipped and
why, sets it aside as ckpt-00000006.corrupt, writes its own step 6 and 8 beside it, and ends with
the same parameters whichever file was damaged; checkpoints whose manifests have no checksums
(written before EDDIS kept them) resume from the newest, with a warning. With every checkpoint
damaged the launch fails with CheckpointCorruptError naming each, before any rank trained a
step, and so does the next one. TensorFlow: 64 bytes flipped in the newest checkpoint's
rank-00000.keras.h5 make the resume take the one before.
"""
import hashlib
import json
import shutil

import pytest

from conftest import PYTHON, REPO, run_process_group
from test_checkpoint_resume import checked, complete, env_for, launch, relative_error, results
from test_checkpoint_verify import flip, truncate

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks


def flipped(folder):
    flip(folder / "rank-00000.pt", folder.joinpath("rank-00000.pt").stat().st_size // 2, 64)
    return "rank-00000.pt has SHA-256"


def truncated(folder):
    truncate(folder / "rank-00001.h5")
    return "rank-00001.h5 has"


def missing(folder):
    (folder / "training.h5").unlink()
    return "lacks training.h5"


def written(tmp_path):
    """Checkpoints of steps 2, 4 and 6 of a sync run of 2 ranks, every file's checksum checked."""
    ckpt = tmp_path / "written"
    checked(launch(tmp_path, tmp_path / "w", "--steps", 6, EDDIS_CHECKPOINT_DIR=ckpt,
                   EDDIS_CHECKPOINT_INTERVAL=2, EDDIS_CHECKPOINT_KEEP=0))
    assert complete(ckpt) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]
    for name in complete(ckpt):
        manifest = json.loads((ckpt / name / "manifest.json").read_text())
        assert sorted(manifest["checksums"]) == sorted(manifest["files"])
        assert {"rank-00000.pt", "rank-00001.pt", "rank-00000.h5", "rank-00001.h5", "training.h5"} \
            <= set(manifest["files"])
        for file, entry in manifest["checksums"].items():
            data = (ckpt / name / file).read_bytes()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, (name, file)
    return ckpt


@pytest.mark.timeout(600)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_one_before_resumed(tmp_path):
    ckpt = written(tmp_path)
    params = {}
    for damage in (flipped, truncated, missing):
        folder = tmp_path / damage.__name__
        shutil.copytree(ckpt, folder)
        said = damage(folder / "ckpt-00000006")
        out = tmp_path / f"out-{damage.__name__}"
        proc = checked(launch(tmp_path, out, "--steps", 8, EDDIS_CHECKPOINT_DIR=folder,
                              EDDIS_CHECKPOINT_INTERVAL=2, EDDIS_CHECKPOINT_KEEP=0))
        text = proc.stdout + proc.stderr
        assert f"checkpoint {folder / 'ckpt-00000006'} fails verification, skipped " \
               "(set aside as ckpt-00000006.corrupt)" in text, text[-4000:]
        assert said in text, text[-4000:]
        assert f"resuming from {folder / 'ckpt-00000004'} (step 4), the newest checkpoint that verifies" in text
        assert [r["start"]["step"] for r in results(out)] == [4, 4], damage.__name__
        # the set-aside one is kept for inspection; the run writes its own step 6 beside it
        assert complete(folder) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006",
                                    "ckpt-00000006.corrupt", "ckpt-00000008"]
        params[damage.__name__] = results(out)[0]["params"]
    assert relative_error(params["truncated"], params["flipped"]) < 1e-6
    assert relative_error(params["missing"], params["flipped"]) < 1e-6

    # checkpoints written before EDDIS kept checksums: the newest resumed unverified, with a warning
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    for name in complete(old):
        manifest = json.loads((old / name / "manifest.json").read_text())
        del manifest["checksums"], manifest["manifest_sha256"]
        (old / name / "manifest.json").write_text(json.dumps(manifest))
    proc = checked(launch(tmp_path, tmp_path / "out-old", "--steps", 8, EDDIS_CHECKPOINT_DIR=old))
    text = proc.stdout + proc.stderr
    assert f"checkpoint {old / 'ckpt-00000006'} was written before EDDIS kept checksums" in text, text[-4000:]
    assert [r["start"]["step"] for r in results(tmp_path / "out-old")] == [6, 6]


@pytest.mark.timeout(400)
def test_with_no_checkpoint_that_verifies_nothing_is_trained_and_the_error_names_each(tmp_path):
    ckpt = written(tmp_path)
    said = [damage(ckpt / name) for damage, name in ((flipped, "ckpt-00000006"), (truncated, "ckpt-00000004"),
                                                      (missing, "ckpt-00000002"))]
    for attempt in ("first", "again"):
        out = tmp_path / attempt
        proc = launch(tmp_path, out, "--steps", 8, EDDIS_CHECKPOINT_DIR=ckpt, EDDIS_CHECKPOINT_INTERVAL=2)
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0, text[-4000:]
        assert "CheckpointCorruptError" in text and f"none of the 3 checkpoints in {ckpt} verifies" in text
        assert all(s in text for s in said), text[-4000:]
        assert not list(out.glob("rank-*.json"))          # no rank got to train
        assert complete(ckpt) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]   # all left in place


@pytest.mark.timeout(600)
def test_tensorflow_resume_skips_a_damaged_newest_checkpoint(tmp_path):
    trainer = REPO / "tests" / "launch_scripts" / "ckpt_tf_trainer.py"
    ckpt = tmp_path / "ckpt"

    def tf_launch(out, steps):
        argv = ["eddis-train", "--local", "-n", "2", PYTHON, str(trainer), "--out", str(out), "--steps", str(steps),
                "--ckpt", str(ckpt)]
        return checked(run_process_group(argv, env_for(tmp_path, EDDIS_CHECKPOINT_DIR=ckpt,
                                                       EDDIS_CHECKPOINT_INTERVAL=2, EDDIS_CHECKPOINT_KEEP=0), 240))

    tf_launch(tmp_path / "first", 4)
    assert complete(ckpt) == ["ckpt-00000002", "ckpt-00000004"]
    model_file = ckpt / "ckpt-00000004" / "rank-00000.keras.h5"
    flip(model_file, model_file.stat().st_size // 2, 64)
    proc = tf_launch(tmp_path / "second", 6)
    text = proc.stdout + proc.stderr
    assert "rank-00000.keras.h5 has SHA-256" in text, text[-4000:]
    assert f"resuming from {ckpt / 'ckpt-00000002'} (step 2), the newest checkpoint that verifies" in text
    assert [r["start"] for r in results(tmp_path / "second")] == [2, 2]
    assert complete(ckpt) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000004.corrupt", "ckpt-00000006"]
