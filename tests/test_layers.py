"""The package's layers hold: import-linter's contracts (`[tool.importlinter]` in pyproject.toml).

The core never imports Lightning; the control plane and the grouping logic never import the
client, the data plane or the exchanges; the client imports only the wire contract; the runtime
never imports the tools; no circles between sub-packages. `lint-imports` prints the same report.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_prague"


def test_every_layer_contract_is_kept():
    # in a process of its own: import-linter configures logging (dictConfig), which would disable the
    # loggers of every later test in this process and of the ranks they fork
    check = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "0 broken" in report and "never imports Lightning" in report, report


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_never_imports_the_benchmarks_folder(path):
    for node in ast.walk(ast.parse(path.read_text())):
        modules = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        assert not any(m == "benchmarks" or m.startswith("benchmarks.") for m in modules), path
    assert "sys.path.insert" not in path.read_text(), f"{path} edits sys.path"


def test_every_sub_package_says_what_runs_where():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)} has no docstring that says what it holds"
