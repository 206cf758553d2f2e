"""What the ranks of a worker started with run_mpi printed: one ``TAG {json}`` line each."""
import json
import re


def rank_results(proc, ranks, tag="RESULT"):
    """``{rank: result}`` from the ``TAG {...}`` lines (JSON objects with a "rank" key); fails,
    with the output, unless the job succeeded and exactly ``ranks`` reported."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    found = {}
    for line in re.findall(rf"{re.escape(tag)} (\{{.*\}})", proc.stdout):
        result = json.loads(line)
        found[result["rank"]] = result
    assert sorted(found) == list(ranks), output[-8000:]
    return found
