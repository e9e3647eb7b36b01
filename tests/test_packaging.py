"""Every sub-package is installed: a non-editable install must not lose a folder of modules."""

from __future__ import annotations

import tomllib

from tests.conftest import REPO_ROOT

#: Folders of the repository and the package name each installs as.
_ROOTS = {"diagnose": "diagnose", "probes": "diagnose.probes", "reports": "diagnose.reports"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, package in _ROOTS.items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO_ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
