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
    max_restarts: int = 0
    startup_timeout: float | None = 300.0
    grace_period: float = 5.0
    timeout: float | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    hosts: list[str] | None = None
    host_index: int = 0
    base_port: int = 29400
    summary_file: str | None = None

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
    config = JobConfig(**data)
    if config.script and not os.path.isabs(config.script):
        config.script = os.path.join(os.path.dirname(os.path.abspath(path)), config.script)
    config.args = [str(a) for a in config.args]
    config.env = {str(k): str(v) for k, v in config.env.items()}
    return config


def _check_types(data: dict, path: str) -> None:
    expected = {"script": str, "module": str, "args": list, "num_workers": int,
                "max_restarts": int, "startup_timeout": (int, float), "grace_period": (int, float),
                "timeout": (int, float), "env": dict, "hosts": list, "host_index": int,
                "base_port": int, "summary_file": str}
    for key, value in data.items():
        if value is None and key in ("startup_timeout", "timeout", "hosts", "script", "module",
                                     "summary_file"):
            continue
        if isinstance(value, bool) or not isinstance(value, expected[key]):
            raise LaunchError(f"Job file {path!r}: '{key}' has the wrong type "
                              f"({type(value).__name__}: {value!r}).")
