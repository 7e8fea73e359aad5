"""Every notebook runs end to end in a fresh kernel of this environment."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    # The "python3" kernel of the running interpreter: this project's venv.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [out for cell in notebook.cells for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors
    assert any(out.get("output_type") == "display_data" and "image/png" in out.get("data", {})
               for cell in notebook.cells for out in cell.get("outputs", [])) \
        or path.name == "02_multi_worker.ipynb"
