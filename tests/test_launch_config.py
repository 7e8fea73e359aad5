"""`LaunchConfig`: the one definition of every launch option, its default and its check."""

import dataclasses
import inspect

import pytest

from tf_distrib.launch import LaunchConfig, LaunchError, cli, launch
from tf_distrib.launch.config import FIELDS, with_overrides
from tf_distrib.launch.job import load_job_file


def test_launch_takes_at_most_six_named_parameters():
    named = [p for p in inspect.signature(launch).parameters.values()
             if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 6, [p.name for p in named]


def test_every_command_line_option_is_a_field_and_every_field_flag_works():
    parser = cli._parser()
    dests = {a.dest for a in parser._actions} - {"help", "config", "module", "script", "args",
                                                "summary_file"}
    assert dests == {name for name, f in FIELDS.items() if f.metadata["cli"]}
    options = parser.parse_args(["--max-restarts", "3", "--hang-timeout", "20", "--preload",
                                 "--hosts", "a, b", "--host-index", "1", "-n", "2", "x.py"])
    config = cli._job_from_args(options).config
    assert (config.max_restarts, config.hang_timeout, config.preload) == (3, 20.0, True)
    assert (config.hosts, config.host_index, config.num_workers) == (["a", "b"], 1, 2)


def test_flags_override_a_job_file_whose_keys_are_the_fields(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("script: train.py\nnum_workers: '1:3'\nmax_restarts: 2\n"
                   "env: {A: 1}\nslot_failures: 4\n")
    loaded = load_job_file(str(job))
    assert (loaded.config.min_workers, loaded.config.num_workers) == (1, 3)
    assert loaded.config.env == {"A": "1"}
    assert loaded.script == str(tmp_path / "train.py")
    options = cli._parser().parse_args(["--config", str(job), "--max-restarts", "5"])
    config = cli._job_from_args(options).config
    assert (config.max_restarts, config.slot_failures) == (5, 4)


@pytest.mark.parametrize("overrides, message", [
    ({"num_workers": 0}, "num_workers must be an integer >= 1, got 0."),
    ({"num_workers": True}, "'num_workers' has the wrong type (bool: True)."),
    ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
    ({"timeout": 0}, "timeout must be > 0 seconds or None, got 0."),
    ({"grace_period": -1.0}, "grace_period must be >= 0 seconds"),
    ({"min_workers": 3, "num_workers": 2}, "min_workers (3) is more than num_workers (2)"),
    ({"hosts": ["a", "b"], "host_index": 2}, "host_index must be in 0..1, got 2."),
    ({"hosts": ["a"], "min_workers": 1, "num_workers": 2}, "use min_hosts, not min_workers"),
    ({"env": {"A": 1}}, "'env' has the wrong type"),
    ({"workers": 2}, "Unknown launch option(s) ['workers']; known options: num_workers,"),
])
def test_bad_options_are_named_before_anything_starts(overrides, message):
    with pytest.raises(LaunchError) as raised:
        with_overrides(None, overrides)
    assert message in str(raised.value)


def test_a_config_is_a_value_that_overrides_replace():
    base = LaunchConfig(num_workers=2, max_restarts=1)
    changed = with_overrides(base, {"max_restarts": 3, "startup_timeout": None})
    assert (base.max_restarts, changed.max_restarts, changed.num_workers) == (1, 3, 2)
    assert changed.startup_timeout is None and base.startup_timeout == 300.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.max_restarts = 2
