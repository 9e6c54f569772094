"""gpukv's own errors live in one module, ``gpukv.core.errors``, and the package exports each."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import gpukv
from gpukv.core import errors

PACKAGE = Path(gpukv.__file__).parent


def test_every_error_is_exported_from_the_package():
    defined = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)}
    assert defined >= {"ConfigError", "BackendError", "TokenError", "LogicError", "BusyError", "IndexFullError", "TreeError"}
    for name in defined:
        assert name in gpukv.__all__ and getattr(gpukv, name) is getattr(errors, name)


def test_no_other_module_of_the_library_defines_an_error():
    # The simulator and the vLLM adapter are applications of the library, with their own.
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("sim", "vllm") or rel == Path("core/errors.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception")) for b in node.bases
            ):
                found.append(f"{rel}: {node.name}")
    assert not found, found

