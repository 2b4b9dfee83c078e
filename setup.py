"""Ships the top-level ``configs/`` folder inside the package, as ``cxrdr/_configs`` (package data):
model configs, experiment recipes, study overlays and prompts, found at run time by
``cxrdr.common.configs``. Folders and files are globbed, so new YAML ships without a change here.
The rest of the metadata is in pyproject.toml (its declarative form cannot map a folder outside the
package tree into the package while also discovering the packages)."""
from setuptools import find_namespace_packages, find_packages, setup

CONFIG_FOLDERS = ["cxrdr._configs"] + ["cxrdr._configs." + p for p in find_namespace_packages(where="configs")]

setup(
    packages=find_packages(include=["cxrdr", "cxrdr.*"]) + CONFIG_FOLDERS,
    package_dir={"cxrdr._configs": "configs"},
    package_data={"cxrdr._configs": ["*.yaml", "**/*.yaml", "**/*.md"]},
)
