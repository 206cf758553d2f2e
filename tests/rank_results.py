"""What each rank of a worker started with run_mpi found, as one JSON file per rank: a
long line printed by several ranks at once can come out of mpirun interleaved."""
import json
import os
from pathlib import Path


def write_result(directory, result):
    """Worker side: ``result`` (a dict with a "rank" key) into ``directory``."""
    path = Path(directory) / f"rank{result['rank']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def rank_results(proc, ranks, directory):
    """``{rank: result}`` from the files in ``directory``; fails, with the output, unless the
    job succeeded and exactly ``ranks`` wrote one."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    found = {int(path.stem[len("rank"):]): json.loads(path.read_text())
             for path in Path(directory).glob("rank*.json")}
    assert sorted(found) == list(ranks), output[-8000:]
    return found
