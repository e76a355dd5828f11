"""Import sglang 0.5.23's PD-disaggregation modules on a CPU-only machine (run inside the
environment that scripts/sglang-env.sh builds).

torchvision 0.28's wheels are CUDA builds whose native library does not load against
torch 2.13+cpu; its `_meta_registrations` then fails on the missing `torchvision::nms`
operator. Defining the two schemas it registers kernels for is enough: kvbridge's checks use
none of torchvision. Run as a script, it imports the modules and prints their version.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = (
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.nixl.conn",
    "sglang.srt.disaggregation.common.conn",
)


def import_sglang() -> dict[str, ModuleType]:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for name in ("nms", "qnms"):
        library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return {name: importlib.import_module(name) for name in MODULES}


if __name__ == "__main__":
    modules = import_sglang()
    version = importlib.import_module("sglang").__version__
    print(f"sglang {version}: imported {', '.join(modules)}")
