"""The code base's shape: short functions and module docstrings, a package per part of the
architecture, imports that only go down its layers, and docs whose names import."""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tf_distrib"
MAX_FUNCTION_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 15
MAX_TOP_LEVEL_FILES = 12
# The architecture's layers, lowest first: a module imports (at import time) only from
# its own part or from lower layers. docs/architecture.md draws the same map.
LAYERS = [
    {"__init__", "_checks", "_compat", "_scratch", "contract"},
    {"cluster", "health"},
    {"transport", "data", "datasets"},
    {"cross_device"},
    {"strategy", "callbacks", "model_parallel", "lr"},
    {"launch", "integrations"},
    {"testing", "chaos"},
    {"bench", "demo", "doctor", "cli"},
]


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _code_lines(lines: list[str], node) -> int:
    """Lines of a function that are neither blank, comments, nor its docstring."""
    skip = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
            and isinstance(first.value.value, str):
        skip = set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in skip and lines[i - 1].strip()
               and not lines[i - 1].strip().startswith("#"))


def test_no_function_is_longer_than_80_lines_of_code():
    long = []
    for path in _sources():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = _code_lines(text.splitlines(), node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_module_docstrings_are_at_most_15_lines():
    long = [f"{p.relative_to(ROOT)} ({len(d.splitlines())})" for p in _sources()
            if (d := ast.get_docstring(ast.parse(p.read_text()), clean=False))
            and len(d.splitlines()) > MAX_MODULE_DOCSTRING_LINES]
    assert not long, long


def test_at_most_12_files_directly_in_the_package():
    files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file())
    assert len(files) <= MAX_TOP_LEVEL_FILES, files


def _import_time_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The tf_distrib modules `path` imports when it is imported (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        for inner in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(inner, ast.Import):
                found |= {a.name for a in inner.names if a.name.startswith("tf_distrib")}
            elif isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith(
                    "tf_distrib"):
                for alias in inner.names:
                    full = f"{inner.module}.{alias.name}"
                    found.add(full if full in modules else inner.module)
    return found & modules


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in _sources()}
    return {m: _import_time_imports(p, set(paths)) for m, p in paths.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def _layer(module: str) -> int:
    part = _part(module)
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _graph()}
    assert parts <= set().union(*LAYERS), parts - set().union(*LAYERS)


def test_imports_only_go_down_the_layers():
    upward = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps
              if _part(m) != _part(d) and _layer(d) >= _layer(m)]
    assert not upward, upward


def test_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for dep in graph[module]:
            if state.get(dep) == "open":
                circles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])
    assert not circles, circles


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `td.x.y`, `tf_distrib.x.y` and `::: tf_distrib.x` as the docs write them.
NAME = re.compile(r"(?<![\w/])(?:td|tf_distrib)(?:\.[A-Za-z_]\w*)+")


def _documented_names() -> list[str]:
    names = set()
    for doc in DOCS:
        for match in NAME.findall(doc.read_text()):
            names.add(re.sub(r"^td\b", "tf_distrib", match))
    return sorted(names)


@pytest.mark.parametrize("name", _documented_names())
def test_every_name_the_docs_show_imports(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            value = getattr(value, attribute)
        return
    pytest.fail(f"{name} does not import")


# How the project was developed belongs in git and CHANGELOG.md, not in what it ships.
HISTORY = re.compile(
    r"\b(?:(?:twenty|thirty|forty)-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|"
    r"ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|"
    r"eighteenth|nineteenth|twentieth|thirtieth)\s+(?:session|round of work)|"
    r"\bthis session\b|\blast session\b|\bsession's (?:run|op|change)", re.IGNORECASE)


def test_nothing_narrates_how_the_project_was_developed():
    texts = [*DOCS, *_sources()]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts
             for m in HISTORY.finditer(p.read_text())]
    assert not found, found
