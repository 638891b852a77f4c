"""A small open_clip model folder with random weights, built here, for exercising the clip extractor.

No package ships CLIP weights and nothing may be downloaded, so the gateway's clip extractor
(gateway/matching/clip.py) cannot be shown real CLIP features here. This builds a folder in open_clip's own layout
(``open_clip_config.json`` + ``open_clip_model.safetensors``) of a ViT with the usual 224-pixel, 16-pixel-patch
input but two narrow layers, seeded, so the extractor's loading, tiling and pooling run for real. Its features
are a random network's: what bench/matching.py reports for it says nothing about trained CLIP.

    python -m bundled.clip --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIG = {
    "model_cfg": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 224, "layers": 2, "width": 128, "head_width": 32, "patch_size": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 1024, "width": 64, "heads": 2, "layers": 1},
    },
    "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]},
}


def build_clip(out: Path, *, seed: int = 0) -> Path:
    """Write the folder (once: an existing one is kept) and return it."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    weights = out / "open_clip_model.safetensors"
    if weights.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "open_clip_config.json").write_text(json.dumps(CONFIG, indent=1))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{out}", device="cpu")  # no weights yet: random init, on purpose
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    print(build_clip(parser.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
