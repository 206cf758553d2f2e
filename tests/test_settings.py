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
