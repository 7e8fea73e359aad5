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

from tf_distrib.launch.config import FIELDS, LaunchConfig, parse_worker_range
from tf_distrib.launch.errors import LaunchError


@dataclasses.dataclass
class Job:
    """What a job file or the command line asks for: a target, its arguments, a config.

    Attributes:
        script: The training script's path, or None with `module`.
        module: The module to run as with `python -m`, or None with `script`.
        args: The script's or module's arguments.
        summary_file: Where `tf-distrib launch` writes its JSON summary, or None.
        config: The `LaunchConfig` of every other option.
    """

    script: str | None = None
    module: str | None = None
    args: list[str] = dataclasses.field(default_factory=list)
    summary_file: str | None = None
    config: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)

    @property
    def target(self) -> str | list[str]:
        """What `launch()` runs: the script, or ["-m", module]."""
        if bool(self.script) == bool(self.module):
            raise LaunchError("Give exactly one of a script or a module (-m) to launch.")
        return ["-m", self.module] if self.module else self.script


_JOB_KEYS = ("script", "module", "args", "summary_file")


def load_job_file(path: str) -> Job:
    """Reads a YAML (.yaml/.yml) or JSON job file into a `Job`.

    Its keys are `Job`'s (script, module, args, summary_file) and `LaunchConfig`'s
    fields; `num_workers` may be "MIN:MAX".

    Raises:
        LaunchError: when the file cannot be read or parsed, has unknown keys or
            values of the wrong type.
    """
    data = _read(path)
    unknown = sorted(set(data) - set(_JOB_KEYS) - set(FIELDS))
    if unknown:
        raise LaunchError(f"Job file {path!r} has unknown key(s) {unknown}; known keys: "
                          f"{', '.join(sorted([*_JOB_KEYS, *FIELDS]))}.")
    job = {key: data.pop(key) for key in _JOB_KEYS if key in data}
    for key, value in job.items():
        wanted = list if key == "args" else str
        if value is not None and not isinstance(value, wanted):
            raise LaunchError(f"Job file {path!r}: '{key}' has the wrong type "
                              f"({type(value).__name__}: {value!r}).")
    if isinstance(data.get("num_workers"), str):
        try:
            data["min_workers"], data["num_workers"] = parse_worker_range(data["num_workers"])
        except LaunchError as e:
            raise LaunchError(f"Job file {path!r}: 'num_workers' has the wrong type or form: "
                              f"{e}") from None
    if isinstance(data.get("env"), dict):
        data["env"] = {str(k): str(v) for k, v in data["env"].items()}
    try:
        config = LaunchConfig(**data)
    except LaunchError as e:
        raise LaunchError(f"Job file {path!r}: {e}") from None
    script = job.get("script")
    if script and not os.path.isabs(script):
        script = os.path.join(os.path.dirname(os.path.abspath(path)), script)
    return Job(script=script, module=job.get("module"),
               args=[str(a) for a in job.get("args") or []],
               summary_file=job.get("summary_file"), config=config)


def _read(path: str) -> dict:
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
    return data
