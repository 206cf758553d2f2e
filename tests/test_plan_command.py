"""``eddis plan``: the table, the recommendation on given inputs, --json, --plot, the errors."""
import json

import pytest

from eddis import cli
from eddis.plan import spec
from eddis.plan.modes import LISTED, MODES

# the comm MLP of bench/cluster.py (3 buckets of 25 MiB at most, in reverse order)
MLP = [16_838_696, 67_108_864, 16_793_600]


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def cluster_file(tmp_path, link="1gbit", nodes=(2, 2), rates=(40.0,), **extra):
    k, r = nodes
    speeds = [rates[i % len(rates)] for i in range(k * r)]
    entries = [{"ranks": [{"samples_per_s": speed, "kind": f"k{speed:g}"} for speed in speeds[j * r:(j + 1) * r]]}
               for j in range(k)]
    return write(tmp_path, "cluster.json", dict({"format": spec.CLUSTER_FORMAT, "link": {"rate": link},
                                                 "nodes": entries}, **extra))


def model_file(tmp_path, **extra):
    return write(tmp_path, "model.json", dict({
        "format": spec.MODEL_FORMAT, "name": "comm MLP", "local_batch": 8, "update_share": 0.2,
        "buckets": [{"bytes": b, "ready": x} for b, x in zip(MLP, (0.85, 0.93, 1.0))]}, **extra))


def plan(capsys, *args):
    status = cli.main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def table(text):
    """{mode: [columns]} of the printed table."""
    rows, on = {}, False
    for line in text.splitlines():
        if line.startswith("---"):
            on = True
            continue
        if on and not line.strip():
            break
        if on and line.startswith("("):
            break
        if on:
            name = "solo" if line.startswith("solo (the ideal)") else line.split()[0]
            rows[name] = line[24:].split()
    return rows


def test_the_table_has_every_mode_and_the_recommendation(tmp_path, capsys):
    status, out, _ = plan(capsys, "--cluster", cluster_file(tmp_path), "--model", model_file(tmp_path))
    assert status == 0
    assert out.startswith("eddis plan (predicted, not measured)")
    rows = table(out)
    assert set(rows) == {"solo", *LISTED}
    assert rows["ddp"][2] == "1.00"                          # x ring of the ring itself
    assert rows["eddis-sync"][5] == "1.00" and rows["ddp"][5] == "1.50" and rows["eddis-sync-flat"][5] == "2.00"
    assert rows["eddis-sync-fp16"][5] == "0.50"
    # no samples to the target in the model: no times to it
    assert rows["eddis-sync"][7] == "-" and rows["eddis-hybrid"][8] == "-"
    # without the elastic modes' sample efficiency, sync (one big batch) is advised, fp16 where it pays
    assert "recommendation: eddis-sync with fp16 on the wire" in out
    assert "eddis-hybrid runs" in out and "give its measured sample_efficiency" in out
    assert "batch split: k40 x4: 8 samples" in out


def test_with_a_measured_efficiency_hybrid_is_advised_at_its_tau(tmp_path, capsys):
    model = model_file(tmp_path, samples_to_target=1380, sample_efficiency={"eddis-hybrid": 0.78},
                       efficiency_tau=4)
    status, out, _ = plan(capsys, "--cluster", cluster_file(tmp_path), "--model", model)
    assert status == 0
    rows = table(out)
    assert rows["eddis-sync"][7] == "1380" and rows["eddis-hybrid"][7] == "1769"   # 1380 / 0.78
    assert "recommendation: eddis-hybrid, tau 4" in out


def test_unequal_speeds_get_the_balanced_split(tmp_path, capsys):
    # 2 x 2 at 10gbit, speeds 1 : 1 : 1/2 : 1/3 (bench/cluster.py's {1,1,2,3} on a simulated device)
    cluster = cluster_file(tmp_path, link="10gbit", rates=(4.5, 4.5, 2.4, 1.6))
    status, out, _ = plan(capsys, "--cluster", cluster, "--model", model_file(tmp_path), "--modes",
                          "ddp,eddis-sync,eddis-balanced")
    assert status == 0
    assert "recommendation: eddis-balanced" in out and "fp32 on the wire" in out
    assert "k4.5 x2: 11 samples, k2.4 x1: 6 samples, k1.6 x1: 4 samples" in out
    assert float(table(out)["eddis-balanced"][2]) > 1.7    # x ring: the ring runs at the slowest's pace


def test_json_and_write_give_the_figures_and_the_inputs(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    status, _, _ = plan(capsys, "--cluster", cluster_file(tmp_path), "--model", model_file(tmp_path),
                        "--nodes", "8", "--link", "100gbit", "--json", out_json, "--write", tmp_path / "used",
                        "--run-steps", "80")
    assert status == 0
    data = json.loads(out_json.read_text())
    assert data["predicted"] is True and data["recommendation"]["mode"] in MODES
    rows = {r["mode"]: r for r in data["modes"]}
    assert rows["ddp"]["bytes_per_node_way_over_S"] == pytest.approx(2 * 15 / 16)   # 8 nodes x 2 ranks
    assert rows["eddis-sync"]["bytes_per_node_way_over_S"] == pytest.approx(2 * 7 / 8)
    assert len(rows["eddis-sync"]["link_out_in"]) == 8
    used = spec.load_cluster(tmp_path / "used" / "cluster.json")
    assert used.num_nodes == 8 and used.nodes[0].link_bps == pytest.approx(100e9 * spec.TCP_PAYLOAD_SHARE / 8)
    assert spec.load_model(tmp_path / "used" / "model.json").gradient_bytes == sum(MLP)


def test_plot_draws_a_png(tmp_path, capsys):
    png = tmp_path / "steps.png"
    status, out, _ = plan(capsys, "--cluster", cluster_file(tmp_path), "--model", model_file(tmp_path),
                          "--plot", png, "--plot-nodes", "1,2,4,16")
    assert status == 0 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("args,message", [
    ([], "needs a cluster"),
    (["--from-profile", "x.h5"], "profile"),
    (["--modes", "sync"], "unknown sync"),
    (["--nodes", "0"], "--nodes"),
    (["--link", "quick"], "--link"),
    (["--plot-nodes", "a,b", "--plot", "x.png"], "--plot-nodes"),
])
def test_bad_options_end_with_status_2_and_say_why(tmp_path, capsys, args, message):
    needs_files = args and args[0] != "--from-profile"
    files = ["--cluster", cluster_file(tmp_path), "--model", model_file(tmp_path)] if needs_files else []
    status, out, err = plan(capsys, *files, *args)
    assert status == 2, out + err
    assert err.startswith("eddis plan: error:") and message in err, err


def test_a_bad_file_names_its_field(tmp_path, capsys):
    bad = write(tmp_path, "c.json", {"format": spec.CLUSTER_FORMAT, "link": {"rate": "1gbit"},
                                     "nodes": [{"ranks": 2, "samples_per_s": 0}]})
    status, _, err = plan(capsys, "--cluster", bad, "--model", model_file(tmp_path))
    assert status == 2 and "c.json.nodes[0].samples_per_s" in err
