"""An open_clip vision tower as the descriptor extractor (``REVISIT_MATCH_EXTRACTOR=clip``).

The weights come only from a local folder (``REVISIT_MATCH_EXTRACTOR_PATH``) in open_clip's own layout: an
``open_clip_config.json`` (with ``model_cfg``) and a checkpoint beside it (``open_clip_model.safetensors`` or the
like). Nothing is downloaded: a folder without weights is refused rather than served with random ones.

Per token: the resized image is cut into tiles of the tower's input size (padded with white at the right and bottom
edges), each tile's patch tokens (before the pooling head) are averaged onto the LLM tokens it covers, and each
token's vector is L2-normalised. Tiles keep CLIP's native scale (a 224-pixel tile holds 8 x 8 LLM tokens of 28
pixels), which a single resize of the whole image to 224 pixels would not. Digests and entropy are the pixel ones.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
from PIL import Image

from gateway.config import ConfigError
from gateway.matching.features import TokenFeatures, resized

TILES_PER_BATCH = 16


class ClipExtractor:
    def __init__(self, folder: Path | str) -> None:
        try:
            import open_clip
            import torch
        except ImportError as exc:
            raise ConfigError(f"the clip extractor needs open_clip_torch and torch: {exc}") from None
        path = Path(folder)
        config = path / "open_clip_config.json"
        if not config.is_file():
            raise ConfigError(f"{path} is not an open_clip model folder (no open_clip_config.json)")
        try:
            model = open_clip.create_model(f"local-dir:{path}", require_pretrained=True, device="cpu")
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot load the open_clip model in {path}: {exc}") from None
        visual = model.visual.eval()
        visual.output_tokens = True
        self._visual = visual
        self._torch = torch
        self._lock = threading.Lock()
        size = visual.image_size
        self._tile = int(size[0] if isinstance(size, tuple | list) else size)
        patch = visual.patch_size
        self._patches = self._tile // int(patch[0] if isinstance(patch, tuple | list) else patch)
        preprocess = json.loads(config.read_text()).get("preprocess_cfg", {})
        self._mean = np.asarray(preprocess.get("mean", (0.48145466, 0.4578275, 0.40821073)), np.float32)
        self._std = np.asarray(preprocess.get("std", (0.26862954, 0.26130258, 0.27577711)), np.float32)
        self.name = "clip-v1-" + hashlib.blake2b(config.read_bytes(), digest_size=6).hexdigest()
        self.dim = int(visual.transformer.width)

    def extract(self, image: Image.Image, grid: tuple[int, int], factor: int) -> TokenFeatures:
        rows, cols = grid
        pixels = resized(image, grid, factor)  # (rows * f, cols * f, 3)
        tile, per_tile = self._tile, self._tile // factor  # LLM tokens per tile side
        if per_tile < 1 or tile % factor:
            raise ValueError(f"the tower's {tile}-pixel input does not hold whole {factor}-pixel tokens")
        tiles_y, tiles_x = -(-rows // per_tile), -(-cols // per_tile)
        canvas = np.full((tiles_y * tile, tiles_x * tile, 3), 255, np.uint8)
        canvas[: pixels.shape[0], : pixels.shape[1]] = pixels
        tiles = canvas.reshape(tiles_y, tile, tiles_x, tile, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, tile, tile)
        batch = (tiles.astype(np.float32) / 255.0 - self._mean[:, None, None]) / self._std[:, None, None]
        torch = self._torch
        outputs = []
        with self._lock, torch.no_grad():
            for start in range(0, len(batch), TILES_PER_BATCH):
                _, tokens = self._visual(torch.from_numpy(batch[start:start + TILES_PER_BATCH]))
                outputs.append(tokens)  # (tiles, patches * patches, width)
        tokens = torch.cat(outputs).reshape(-1, self._patches, self._patches, self.dim).permute(0, 3, 1, 2)
        pooled = torch.nn.functional.adaptive_avg_pool2d(tokens, per_tile)  # (tiles, width, per_tile, per_tile)
        grid_map = pooled.reshape(tiles_y, tiles_x, self.dim, per_tile, per_tile).permute(0, 3, 1, 4, 2)
        vectors = grid_map.reshape(tiles_y * per_tile, tiles_x * per_tile, self.dim)[:rows, :cols].numpy()
        return TokenFeatures.of_pixels(image, grid, factor, pixels, vectors.reshape(rows * cols, self.dim))
