"""Nothing another process wrote runs code here: no pickle, eval or unsafe torch.load in the package.

The package's source is read as syntax trees: no module imports a deserializer that can run code
(pickle and its kin), nothing calls `eval`/`exec`/`compile`/`__import__`, every `torch.load` passes
`weights_only=True`, and `importlib.import_module` appears only where its argument is the user's
own configuration (a command line, a config file) or a constant, never a message. The one place
that reads objects other processes sent over the data plane (`encode_object`/`decode_object`) is
tried with a payload that would run code.
"""

from __future__ import annotations

import ast
import io
import os
from pathlib import Path

import pytest
import torch

import lightning_prague
from lightning_prague.core.comm.collectives import decode_object, encode_object

PACKAGE = Path(lightning_prague.__file__).parent
#: deserializers that run code chosen by their input
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
#: where `importlib.import_module` may be called, and why its argument is trusted
IMPORTS_ALLOWED = {
    "cli_names.py": "a strategy class path the user wrote on the command line or in a config file",
    "strategies/_checks.py": "the constant table of Lightning internals this package checks at setup",
    "strategies/options.py": "the module classes of `auto_wrap_policy`, which the user's code or config file names",
    "tools/cluster/srun.py": "the module the emulator's own command line names",
}


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _called_name(node: ast.Call) -> str:
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def test_no_module_of_the_package_can_run_code_that_its_input_chooses():
    problems = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
                problems += [f"{name}:{node.lineno} imports {b}" for b in bad]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{name}:{node.lineno} imports from {node.module}")
            elif isinstance(node, ast.Call):
                called = _called_name(node)
                if called in FORBIDDEN_CALLS:
                    problems.append(f"{name}:{node.lineno} calls {called}")
                elif called.endswith("torch.load"):
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not weights_only or not (
                        isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True
                    ):
                        problems.append(f"{name}:{node.lineno} calls torch.load without weights_only=True")
                elif called.endswith("import_module") and name not in IMPORTS_ALLOWED:
                    problems.append(f"{name}:{node.lineno} imports a module by a name it was given")
    assert problems == []


def test_the_scan_sees_what_it_forbids(tmp_path):
    tree = ast.parse(
        "import pickle\nfrom marshal import loads\neval('1')\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
    )
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append("import")
        elif isinstance(node, ast.Call):
            found.append(_called_name(node))
    assert found == ["import", "import", "eval", "torch.load", "torch.load"]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def test_an_object_from_another_member_is_read_without_running_code():
    payload = io.BytesIO()
    torch.save({"checkpoint": _RunsCode()}, payload)  # what a hostile peer could send as a broadcast's bytes
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        decode_object(payload.getvalue())
    assert encode_object(_RunsCode()) is None  # and the sender finds out before sending
    value = {"path": Path("/ckpt/epoch=1.ckpt"), "best": torch.tensor([0.5]), "names": ["a", ("b", 2)]}
    decoded = decode_object(encode_object(value))
    assert decoded["path"] == value["path"] and decoded["names"] == ["a", ("b", 2)]
    assert torch.equal(decoded["best"], value["best"])
