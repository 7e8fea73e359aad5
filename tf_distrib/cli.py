"""The `tf-distrib` command: launch, top, demo, bench, doctor, chaos."""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "launch": ("tf_distrib.launch.cli", "start N workers with TF_CONFIG, restart on failure"),
    "top": ("tf_distrib.launch.top", "a live per-worker view of a running launch"),
    "demo": ("tf_distrib.demo", "2-worker MultiWorkerMirroredStrategy training demo"),
    "bench": ("tf_distrib.bench", "benchmarks against TensorFlow's built-ins"),
    "doctor": ("tf_distrib.doctor", "check versions, devices, cluster config and ports"),
    "chaos": ("tf_distrib.chaos", "trials of a 2-worker job under faults, checked bitwise"),
}


def _usage() -> str:
    lines = ["usage: tf-distrib COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in _COMMANDS.items()]
    lines.append("\n'tf-distrib COMMAND --help' describes a command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib COMMAND ...`: dispatch to the command's own `main`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"tf-distrib: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(_COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
