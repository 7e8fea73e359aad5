"""Every notebook runs end to end in a fresh kernel of this environment."""

import importlib.util
import pathlib

import pytest

FOLDER = pathlib.Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("execute", FOLDER / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)


def outputs(notebook):
    return [out for cell in notebook.cells for out in cell.get("outputs", [])]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = execute.execute(path)
    assert not [out for out in outputs(notebook) if out.get("output_type") == "error"]
    assert any(out.get("output_type") == "display_data" and "image/png" in out.get("data", {})
               for out in outputs(notebook)) or path.name == "02_multi_worker.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_its_outputs(path):
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.get("outputs") or not cell.source.strip() for cell in code[-1:]), (
        f"{path.name} has no outputs: run `make notebooks` and commit the result")
