"""Runs notebooks end to end in a fresh kernel; with --write, keeps their outputs in them.

`make notebooks` writes every notebook's outputs (plots included) back into it, so that
notebooks read as documents where they are browsed; the tests run them the same way
without writing.

Usage: python notebooks/execute.py [--write] NOTEBOOK.ipynb ...
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import nbformat
from nbclient import NotebookClient


def execute(path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook at `path`, run in a fresh kernel of this interpreter's environment.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed.
    """
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


# TensorFlow's C++ start-up lines (timestamps, process ids, CUDA probing on CPU-only
# machines): noise in a saved notebook, and a new diff at every run.
_TF_LOG_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
                          r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ )")


def without_tensorflow_log_lines(notebook: nbformat.NotebookNode) -> None:
    """Drops TensorFlow's C++ log lines from the notebook's stderr outputs."""
    for cell in notebook.cells:
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                output["text"] = "".join(line for line in output["text"].splitlines(True)
                                         if not _TF_LOG_LINE.match(line))
                if not output["text"]:
                    continue
            kept.append(output)
        if cell.cell_type == "code":
            cell.outputs = kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="save the outputs into the files")
    parser.add_argument("notebooks", nargs="+", type=pathlib.Path)
    options = parser.parse_args(argv)
    for path in options.notebooks:
        notebook = execute(path)
        if options.write:
            without_tensorflow_log_lines(notebook)
            for cell in notebook.cells:
                cell.metadata.pop("execution", None)  # timestamps: noise in every diff
            nbformat.write(notebook, path)
        print(f"{path}: ran{' and saved its outputs' if options.write else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
