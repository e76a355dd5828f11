"""Build the Python packages the GPU check needs on the lent GPU machine, which has torch and
numpy but no package index: pyzmq, NIXL (`nixl-cu12`, pinned in requirements/engines.txt) and
the CUDA 12 runtime NIXL's UCX CUDA module links against. They are unpacked for CPython 3.12
into one folder (`.whl/site`, ignored by git) and pruned to what NIXL's UCX path loads: the
whole NIXL wheel (68 MB, its object-store plugins and their AWS, Azure and gRPC libraries) is
over the 64 MiB that may travel to the machine.

    python scripts/gpu_site.py            # then: scripts/gpu-check.sh on the GPU machine
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = WHEELS / "site"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
PACKAGES = ("pyzmq==27.3.0", "nvidia-cuda-runtime-cu12==12.9.79")
KEPT_PLUGINS = ("libplugin_UCX.so", "libplugin_POSIX.so")
# UCX modules kept: shared memory between processes and CUDA (copy and IPC). The InfiniBand
# modules pull 22 MB of libibverbs, mlx5 and netlink libraries for hardware the check
# does not use.
KEPT_UCX_MODULES = re.compile(r"lib(ucm_cuda|uct_cma|uct_cuda)\.so")


def pinned_nixl() -> str:
    for line in (ROOT / "requirements" / "engines.txt").read_text().splitlines():
        if line.startswith("nixl-cu12=="):
            return line.strip()
    raise SystemExit("requirements/engines.txt pins no nixl-cu12")


def download(requirements: list[str]) -> list[Path]:
    WHEELS.mkdir(exist_ok=True)
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(WHEELS),
            *requirements,
        ],
        check=True,
    )
    # The pinned versions' wheels only (older downloads may lie beside them).
    prefixes = tuple(r.replace("-", "_").replace("==", "-").lower() + "-" for r in requirements)
    return [w for w in WHEELS.glob("*.whl") if w.name.lower().startswith(prefixes)]


def needed(library: Path) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic.stdout)


def prune() -> None:
    """Keep NIXL's UCX and POSIX plugins, the UCX modules above, and the libraries they and
    NIXL's bindings load, transitively; drop the rest."""
    shutil.rmtree(SITE / "nixl_ep_cu12", ignore_errors=True)
    for folder in SITE.glob("nixl_cu12*.data"):
        shutil.rmtree(folder)
    shutil.rmtree(SITE / "nixl_cu12.scripts", ignore_errors=True)
    shutil.rmtree(SITE / "nvidia" / "cuda_runtime" / "include", ignore_errors=True)
    for archive in (SITE / "nvidia").rglob("*.a"):
        archive.unlink()
    for plugin in SITE.glob("*nixl_cu12*/**/libplugin_*.so"):
        if plugin.name not in KEPT_PLUGINS:
            plugin.unlink()
    for telemetry in SITE.glob("*nixl_cu12*/**/libtelemetry_*.so"):
        telemetry.unlink()
    for module in (SITE / "nixl_cu12.libs" / "ucx").iterdir():
        if not KEPT_UCX_MODULES.match(module.name):
            module.unlink()
    candidates = {
        path.name: path
        for folder in (SITE / "nixl_cu12.libs", SITE / ".nixl_cu12.mesonpy.libs")
        for path in folder.glob("*.so*")
    }
    roots = [
        *SITE.glob("nixl_cu12/*.so"),
        *SITE.glob("*nixl_cu12*/**/libplugin_*.so"),
        *(SITE / "nixl_cu12.libs" / "ucx").glob("*.so*"),
    ]
    reached: set[Path] = set()
    pending = list(roots)
    while pending:
        library = pending.pop()
        if library in reached:
            continue
        reached.add(library)
        pending.extend(candidates[name] for name in needed(library) if name in candidates)
    for path in candidates.values():
        if path not in reached:
            path.unlink()


def main() -> None:
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    for wheel in download([pinned_nixl(), *PACKAGES]):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(SITE)
    prune()
    size = sum(path.stat().st_size for path in SITE.rglob("*") if path.is_file())
    print(f"{SITE.relative_to(ROOT)}: {size / 2**20:.0f} MiB for CPython 3.12 on x86-64")


if __name__ == "__main__":
    main()
