"""The one part of the tzip wheel that pyproject.toml cannot say: ``tzip-attach.pth`` at the top of site-packages.

Python's site module runs a ``.pth`` line that starts with ``import`` at every interpreter start-up; this one
(``tzip.attaching.PTH_LINE``) attaches the job to tzip when ``TZIP_ATTACH=1`` and otherwise costs one environment
lookup (python-bridge/tzip/attaching.py). Everything else about the package is in pyproject.toml.

setuptools puts pyproject's data-files under the install prefix, not into site-packages, so the file is written
into the build folder by ``build_py`` (the way pytest-cov ships its .pth). Its text is read from
``tzip/attaching.py`` (the literal ``PTH_LINE``), so the two cannot disagree. An editable install
(``pip install -e``) does not carry it: there ``python -m tzip.attaching install-pth`` writes it.
"""

from __future__ import annotations

import ast
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_NAME = "tzip-attach.pth"


def pth_line() -> str:
    """The value of ``PTH_LINE`` in tzip/attaching.py, read without importing the package (no torch here)."""
    source = os.path.join(HERE, "tzip", "attaching.py")
    with open(source, encoding="utf-8") as f:
        tree = ast.parse(f.read(), source)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "PTH_LINE" for t in targets) and node.value is not None:
            line = ast.literal_eval(node.value)
            if isinstance(line, str) and line.startswith("import ") and line.endswith("\n") and line.count("\n") == 1:
                return line
            raise RuntimeError(f"{source}: PTH_LINE must be one line starting with 'import ' and ending with a newline")
    raise RuntimeError(f"{source} defines no PTH_LINE")


class build_py_with_pth(build_py):
    """build_py, plus tzip-attach.pth at the top of the build folder (the wheel's root)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        os.makedirs(self.build_lib, exist_ok=True)
        with open(os.path.join(self.build_lib, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(pth_line())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": build_py_with_pth})
