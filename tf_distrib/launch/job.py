"""Job files: a launch described in YAML or JSON, like cloud training services' job specs.

Example `job.yaml`:

```yaml
script: train.py          # or  module: mypkg.train
args: ["--epochs", "5"]
num_workers: 2
max_restarts: 3
env: {TF_CPP_MIN_LOG_LEVEL: "2"}
```

Relative script paths are resolved against the job file's directory.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tf_distrib.launch.errors import LaunchError


@dataclasses.dataclass
class JobConfig:
    """Everything `tf-distrib launch` needs; the command line overrides a job file.

    Its field defaults are the launcher's defaults, for the command line, job files,
    `launch()` and `tf_distrib.testing` alike (`DEFAULTS`).
    """

    script: str | None = None
    module: str | None = None
    args: list[str] = dataclasses.field(default_factory=list)
    num_workers: int = 1
    min_workers: int | None = None
    max_restarts: int = 0
    startup_timeout: float | None = 300.0
    hang_timeout: float | None = None
    grace_period: float = 5.0
    timeout: float | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    hosts: list[str] | None = None
    host_index: int = 0
    base_port: int = 29400
    min_hosts: int | None = None
    rendezvous_timeout: float = 60.0
    slot_failures: int = 2
    rejoin_interval: float = 600.0
    summary_file: str | None = None
    log_dir: str | None = None
    verbose: bool = False
    preload: bool | None = None

    @property
    def target(self) -> str | list[str]:
        if bool(self.script) == bool(self.module):
            raise LaunchError("Give exactly one of a script or a module (-m) to launch.")
        return ["-m", self.module] if self.module else self.script


DEFAULTS = JobConfig()
_FIELDS = {f.name for f in dataclasses.fields(JobConfig)}


def load_job_file(path: str) -> JobConfig:
    """Reads a YAML (.yaml/.yml) or JSON job file into a `JobConfig`.

    Raises:
        LaunchError: when the file cannot be read or parsed, has unknown keys or
            values of the wrong type.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"Cannot read job file {path!r}: {e.strerror}.") from None
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        if is_yaml:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types; both mean "bad file"
        kind = "YAML" if is_yaml else "JSON"
        raise LaunchError(f"Job file {path!r} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise LaunchError(f"Job file {path!r} must hold a mapping of settings, got "
                          f"{type(data).__name__}.")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise LaunchError(f"Job file {path!r} has unknown key(s) {unknown}; known keys: "
                          f"{', '.join(sorted(_FIELDS))}.")
    _check_types(data, path)
    if isinstance(data.get("num_workers"), str):
        try:
            data["min_workers"], data["num_workers"] = parse_worker_range(data["num_workers"])
        except LaunchError as e:
            raise LaunchError(f"Job file {path!r}: 'num_workers' has the wrong type or form: "
                              f"{e}") from None
    config = JobConfig(**data)
    if config.script and not os.path.isabs(config.script):
        config.script = os.path.join(os.path.dirname(os.path.abspath(path)), config.script)
    config.args = [str(a) for a in config.args]
    config.env = {str(k): str(v) for k, v in config.env.items()}
    return config


def parse_worker_range(text: str) -> tuple[int | None, int]:
    """"N" -> (None, N); "MIN:MAX" -> (MIN, MAX) (an elastic launch).

    Raises:
        LaunchError: anything else, or MIN > MAX, or a count below 1.
    """
    low, sep, high = str(text).partition(":")
    if not (low.isdigit() and (not sep or high.isdigit())):
        raise LaunchError(f"The number of workers must be N or MIN:MAX (e.g. 2 or 1:4), got "
                          f"{text!r}.")
    minimum, maximum = int(low), int(high) if sep else int(low)
    if not sep and maximum < 1:
        raise LaunchError(f"num_workers must be an integer >= 1, got {text}.")
    if minimum < 1 or minimum > maximum:
        raise LaunchError(f"The number of workers MIN:MAX needs 1 <= MIN <= MAX, got {text!r}.")
    return (minimum if sep else None), maximum


def _check_types(data: dict, path: str) -> None:
    seconds = (int, float)
    expected = {"script": str, "module": str, "args": list, "num_workers": (int, str),
                "min_workers": int, "max_restarts": int, "startup_timeout": seconds,
                "hang_timeout": seconds, "grace_period": seconds, "timeout": seconds,
                "env": dict, "hosts": list, "host_index": int, "base_port": int,
                "min_hosts": int, "rendezvous_timeout": seconds, "slot_failures": int,
                "rejoin_interval": seconds, "summary_file": str, "log_dir": str,
                "verbose": bool, "preload": bool}
    for key, value in data.items():
        if value is None and key in ("startup_timeout", "hang_timeout", "timeout", "hosts",
                                     "script", "module", "summary_file", "min_workers",
                                     "min_hosts", "log_dir", "preload"):
            continue
        if (isinstance(value, bool) != (expected[key] is bool)
                or not isinstance(value, expected[key])):
            raise LaunchError(f"Job file {path!r}: '{key}' has the wrong type "
                              f"({type(value).__name__}: {value!r}).")
