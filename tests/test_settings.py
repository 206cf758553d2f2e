"""The settings registry through the `eddis` command, and the subcommand plumbing."""
import subprocess

import pytest

from conftest import PYTHON, REPO, python_env
from eddis import cli, settings


def eddis(*args, env=None):
    return subprocess.run([PYTHON, "-m", "eddis.cli", *args], env=python_env(env), capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(90)
def test_settings_prints_every_registered_setting():
    proc = eddis("settings")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == settings.markdown_table()
    for name in set(settings.REGISTRY) - settings.internal_variables():
        assert f"`{name}`" in proc.stdout


@pytest.mark.timeout(90)
def test_settings_check_catches_a_misspelt_variable():
    proc = eddis("settings", "--check", env={"EDDIS_MOED": "sync"})
    assert proc.returncode == 2
    assert "EDDIS_MOED" in proc.stderr and "Did you mean EDDIS_MODE" in proc.stderr
    assert eddis("settings", "--check").returncode == 0


@pytest.mark.timeout(90)
def test_settings_get_reads_environment_and_default():
    assert eddis("settings", "--get", "EDDIS_DEV_CLUSTER_PORT").stdout.strip() == "16817"
    proc = eddis("settings", "--get", "EDDIS_DEV_CLUSTER_PORT", env={"EDDIS_DEV_CLUSTER_PORT": "nope"})
    assert proc.returncode == 2 and "not a valid int" in proc.stderr


def test_every_subcommand_target_loads_and_has_the_interface():
    for name, target, help_text in cli.SUBCOMMANDS:
        handler = cli.load_target(target)
        assert callable(handler.add_arguments) and callable(handler.run), name
        assert help_text


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_subcommand_module_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMANDS", cli.SUBCOMMANDS + [("ghost", "eddis.no_such_module", "x")])
    with pytest.raises(SystemExit) as exc:
        cli.main(["ghost"])
    assert exc.value.code == 2
    assert "eddis ghost: not available" in capsys.readouterr().err


def test_user_guide_lists_every_setting():
    text = (REPO / "docs" / "user-guide.md").read_text()
    missing = [name for name in settings.REGISTRY if name not in text]
    assert not missing, f"docs/user-guide.md lacks {missing}: paste the output of `eddis settings` into it"


def test_every_variable_the_launcher_exports_is_a_typed_internal_entry():
    from eddis.launch.rankenv import RankInfo

    info = RankInfo(3, 8, 1, 2, 1, 2, 4, "n2", "a100", "0", "slurm")
    exported = {k for k in info.environ() if k.startswith("EDDIS_")}
    assert exported - {"EDDIS_GPU_TYPE"} <= settings.internal_variables()
    env = {k: v for k, v in info.environ().items()}
    settings.check_environment(env)  # what the launcher writes parses
    assert settings.get("EDDIS_RANK", env) == 3 and settings.get("EDDIS_LAUNCHED", env) is True


def test_a_malformed_launcher_variable_is_named():
    from eddis.errors import ConfigError

    with pytest.raises(ConfigError, match="EDDIS_GROUP='two' is not a valid int"):
        settings.check_environment({"EDDIS_GROUP": "two"})


def test_one_rule_gives_the_node_name():
    from eddis import identity

    assert identity.node_name({"EDDIS_HOSTNAME": "a", "SLURMD_NODENAME": "b"}) == "a"
    assert identity.node_name({"SLURMD_NODENAME": "b"}) == "b"
    assert identity.node_name({}) == __import__("socket").gethostname()


def test_a_bool_or_auto_setting_reads_auto_and_boolean_words():
    overlap = settings.REGISTRY["EDDIS_EASGD_OVERLAP"]
    assert overlap.default == "auto"
    assert [overlap.parse(t) for t in ("auto", "AUTO", "1", "on", "0", "off")] == \
        ["auto", "auto", True, True, False, False]
    with pytest.raises(settings.ConfigError, match="EDDIS_EASGD_OVERLAP='sometimes'"):
        overlap.parse("sometimes")


def _ranged():
    return [s for s in settings.REGISTRY.values() if s.range_text()]


def test_every_numeric_setting_has_a_range():
    numeric = [s.name for s in settings.REGISTRY.values() if s.type in settings.NUMERIC_TYPES]
    assert numeric and sorted(numeric) == sorted(s.name for s in _ranged())


def _just_outside(setting):
    """Values on the wrong side of each bound of the setting's range, as text."""
    step = 0.5 if setting.type == "float" else 1
    if setting.min is not None:
        yield settings.number_text(setting.min if setting.above_min else setting.min - step)
    if setting.max is not None:
        yield settings.number_text(setting.max + step)


def _bounds(setting):
    """The values at each bound that the range includes, as text."""
    if setting.min is not None:
        yield settings.number_text(setting.min + 0.5 if setting.above_min else setting.min)
    if setting.max is not None:
        yield settings.number_text(setting.max)


@pytest.mark.parametrize("name", sorted(s.name for s in _ranged()))
def test_values_outside_the_range_are_refused_naming_setting_value_and_range(name):
    setting = settings.REGISTRY[name]
    for text in _bounds(setting):
        assert settings.get(name, {name: text}) == settings.PARSERS[setting.type](text)
    outside = list(_just_outside(setting))
    assert outside
    for text in outside:
        with pytest.raises(settings.ConfigError) as err:
            settings.get(name, {name: text})
        assert str(err.value).startswith(f"{name}={text!r} is out of range: {name} must be {setting.range_text()}")
    if setting.type == "float":
        for text in ("nan", "inf", "-inf"):
            with pytest.raises(settings.ConfigError, match=f"{name}='{text}' is not a finite number"):
                settings.get(name, {name: text})


@pytest.mark.parametrize("name, text, message", [
    ("EDDIS_LIVENESS_TIMEOUT", "-5", "EDDIS_LIVENESS_TIMEOUT='-5' is out of range: EDDIS_LIVENESS_TIMEOUT must "
                                     "be >= 0 (default 30.0)."),
    ("EDDIS_COMM_TIMEOUT", "0", "EDDIS_COMM_TIMEOUT must be > 0"),
    ("EDDIS_EASGD_ALPHA", "1.5", "EDDIS_EASGD_ALPHA must be > 0 and <= 1."),
    ("EDDIS_DEV_CLUSTER_NODES", "9", "EDDIS_DEV_CLUSTER_NODES must be 2 to 8"),
    ("SMB_MEMORY", "0K", "SMB_MEMORY must be >= 1"),
    ("EDDIS_STALENESS", "-2", "EDDIS_STALENESS must be >= -1"),
])
def test_the_issues_values_are_refused(name, text, message):
    with pytest.raises(settings.ConfigError) as err:
        settings.check_environment({name: text})
    assert message in str(err.value)


@pytest.mark.timeout(90)
def test_settings_command_shows_and_checks_the_range():
    proc = eddis("settings")
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| `EDDIS_LIVENESS_TIMEOUT` |"))
    assert "Range: `>= 0`." in row
    proc = eddis("settings", "--check", env={"EDDIS_LIVENESS_TIMEOUT": "-5"})
    assert proc.returncode == 2
    assert "EDDIS_LIVENESS_TIMEOUT='-5' is out of range: EDDIS_LIVENESS_TIMEOUT must be >= 0" in proc.stderr


@pytest.mark.timeout(90)
def test_eddis_train_refuses_zero_ranks_before_anything_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("open('started', 'w').close()\n")
    for argv in (["--local", "-n", "0"], ["--local", "--np=-3"]):
        proc = subprocess.run([PYTHON, "-m", "eddis.launch.train", *argv, str(script)], env=python_env(),
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"argument -n/--np: -n {argv[-1].split('=')[-1]} is out of range: EDDIS_SIZE must be >= 1" \
            in proc.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv, said", [
    (["eddis.launch.train", "--local", "--mode", "sideways"],
     "argument --mode: --mode sideways is not one of sync, allreduce, easgd, hybrid"),
    (["eddis.launch.train", "--local", "--memory", "lots"], "argument --memory: --memory lots is not a valid size"),
    (["eddis.smb.server", "--port", "70000"], "argument --port: --port 70000 is out of range"),
    (["eddis.smb.server", "--hugepages", "giant"], "argument --hugepages: --hugepages giant is not one of"),
    (["eddis.smb.server", "--reduce-threads", "-1"], "argument --reduce-threads: --reduce-threads -1 is out of range"),
], ids=["train-mode", "train-memory", "server-port", "server-hugepages", "server-threads"])
def test_entry_points_check_their_flags_through_the_registry(tmp_path, argv, said):
    """A bad flag stops eddis-train or smb-server at once (argparse, status 2), as the setting
    it stands for would, before anything starts."""
    script = tmp_path / "train.py"
    script.write_text("open('started', 'w').close()\n")
    extra = [str(script)] if argv[0] == "eddis.launch.train" else []
    proc = subprocess.run([PYTHON, "-m", *argv, *extra], env=python_env(), capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and said in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "started").exists()


def test_a_flag_keeps_its_text_when_asked():
    memory = settings.REGISTRY["SMB_MEMORY"].flag_type(keep_text=True)
    assert memory("4G") == "4G"
    with pytest.raises(__import__("argparse").ArgumentTypeError, match="--memory 0 is out of range"):
        memory("0")


def test_a_flag_reads_through_the_registry():
    memory = settings.REGISTRY["SMB_MEMORY"].flag_type()
    assert memory("4K") == 4096
    with pytest.raises(__import__("argparse").ArgumentTypeError, match="--memory -1 is not a valid size"):
        memory("-1")
    with pytest.raises(settings.ConfigError, match="a range is for numeric settings"):
        settings.register("EDDIS_TEST_NOT_NUMERIC", "str", None, "x", min=1)
    assert "EDDIS_TEST_NOT_NUMERIC" not in settings.REGISTRY
