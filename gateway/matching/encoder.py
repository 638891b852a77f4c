"""The VLM's own vision tower as the descriptor extractor (``REVISIT_MATCH_EXTRACTOR=encoder``).

Each token's vector is the vision tower's merged output for it: what the language model reads, so two tokens the
model sees alike score alike. The cost is a vision-tower pass in the gateway before the plan is chosen, which is
why it is not the default: it suits small towers on CPU, or a gateway with an accelerator of its own. The weights
come from the model folder named by ``REVISIT_MATCH_EXTRACTOR_PATH`` (default ``REVISIT_MODEL_DIR``, the served
model's folder; never downloaded);
torch and transformers must be installed where the gateway runs.

An entry's stored encoder output is the same tower's output for the same pixels, so these vectors are what the
entry itself holds; they are computed at intake all the same, because the lookup needs the new image's before any
entry is read. Digests and entropy are the pixel ones (gateway.matching.features).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from PIL import Image

from gateway.config import ConfigError
from gateway.matching.features import TokenFeatures, resized


class EncoderExtractor:
    def __init__(self, model_dir: Path | str) -> None:
        try:
            import torch
            from transformers import AutoImageProcessor, AutoModelForImageTextToText
        except ImportError as exc:  # the gateway's own image carries neither
            raise ConfigError(f"the encoder extractor needs torch and transformers: {exc}") from None
        path = Path(model_dir)
        try:
            self._processor = AutoImageProcessor.from_pretrained(path)
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the vision tower from {path}: {exc}") from None
        self._model = model.eval()
        self._torch = torch
        self._lock = threading.Lock()  # one forward at a time: torch's own threads do the parallel work
        weights = (path / "config.json").read_bytes() if (path / "config.json").is_file() else str(path).encode()
        self.name = "encoder-v1-" + hashlib.blake2b(weights, digest_size=6).hexdigest()
        self.dim = int(model.config.text_config.hidden_size)

    def extract(self, image: Image.Image, grid: tuple[int, int], factor: int) -> TokenFeatures:
        pixels = resized(image, grid, factor)  # (rows * f, cols * f, 3)
        area = pixels.shape[0] * pixels.shape[1]  # the grid is the gateway's: the processor must keep this size
        inputs = self._processor(images=[Image.fromarray(pixels)], return_tensors="pt",
                                 size={"shortest_edge": area, "longest_edge": area})
        with self._lock, self._torch.no_grad():
            out = self._model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                       return_dict=True)
        embeds = out.pooler_output[0].float().numpy()  # (n, hidden), merged tokens in row-major grid order
        if embeds.shape[0] != grid[0] * grid[1]:
            raise ValueError(f"the vision tower gave {embeds.shape[0]} tokens for a {grid} grid")
        return TokenFeatures.of_pixels(image, grid, factor, pixels, embeds)
