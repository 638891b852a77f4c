"""The partial vision pass on SGLang's own vision towers (engine_ext.vision), checked against SGLang and the reference.

SGLang's Qwen2.5-VL and Qwen3-VL models are built by SGLang's own loader (``get_model``, CPU, float32, SGLang's
parallel state for one rank over gloo) in a plain child process, not a worker: building them in the pytest process
would leave the ``sgl_kernel`` stand-in imported, a torch.distributed group and SGLang's process-wide config behind
(tests/launcher/test_cpu_support.py checks that the stand-in is not importable). The child runs this module as a
script on inputs the test prepares with the reference's processor, and returns SGLang's outputs for the test to
compare: the worker and the reference must agree.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from bundled import ARCHS
from engine_ext.vision import margin_tokens, window_tokens_of
from launcher.cpu_support import kernel_stand_in_path
from offline.reference import Prompt, ReferenceModel
from offline.reference.vision import encode_partial

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 300


def subset_of(model: ReferenceModel, grid: tuple[int, int]) -> torch.Tensor:
    """The margin tokens of a 2 x 2 block of changed tokens near the bottom right (a partial window there)."""
    h, w = grid
    changed = torch.zeros(h, w, dtype=torch.bool)
    changed[h - 2:, w - 3:w - 1] = True
    margin = margin_tokens(changed, arch=model.arch, window_tokens=window_tokens_of(model.hf.model.visual))
    return margin.flatten().nonzero()[:, 0]


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 168))  # Qwen2.5-VL: 6 x 8 tokens, a row of 2-token-high windows at the bottom


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, ReferenceModel]:
    return {arch: ReferenceModel.load(tiny_models[arch]) for arch in ARCHS}


@pytest.fixture(scope="module")
def prompts(references: dict[str, ReferenceModel], picture: Image.Image) -> dict[str, Prompt]:
    return {arch: model.prompt([picture, "What is it?"]) for arch, model in references.items()}


@pytest.fixture(scope="module")
def inputs(references: dict[str, ReferenceModel], prompts: dict[str, Prompt], tiny_models: dict[str, Path]) -> dict:
    """arch -> what the child gets: the model's directory, one image's processor output and a subset of its tokens."""
    return {arch: {"path": str(tiny_models[arch]), "pixel_values": prompt.pixel_values,
                   "grid_thw": prompt.image_grid_thw, "subset": subset_of(references[arch], prompt.images[0].grid[1:])}
            for arch, prompt in prompts.items()}


@pytest.fixture(scope="module")
def sglang(inputs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """arch -> SGLang's outputs on ``inputs``: its own forward, the partial pass over every token and over the
    subset (each flat: embeddings then deepstack features), and the attention backend it used."""
    folder = tmp_path_factory.mktemp("sglang-vision")
    torch.save(inputs, folder / "inputs.pt")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    stand_in = kernel_stand_in_path()
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (stand_in, REPO, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine_ext.test_partial_vision_sglang", str(folder / "inputs.pt"),
         str(folder / "outputs.pt")], cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-6000:]
    return torch.load(folder / "outputs.pt")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_runs_its_cpu_attention(sglang: dict, arch: str) -> None:
    assert sglang[arch]["backend"] == "VisionSdpaAttention"
    assert sglang[arch]["dtype"] == torch.float32


@pytest.mark.parametrize("arch", ARCHS)
def test_every_token_is_sglangs_own_forward(sglang: dict, arch: str) -> None:
    assert sglang[arch]["all"].shape == sglang[arch]["full"].shape
    assert relative(sglang[arch]["all"], sglang[arch]["full"]) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_every_token_is_the_reference_full_pass(sglang: dict, references: dict, prompts: dict, arch: str) -> None:
    full = references[arch].encode(prompts[arch])[0].flat()
    assert relative(sglang[arch]["all"], full) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_worker_and_reference_agree_on_a_subset(sglang: dict, references: dict, inputs: dict, arch: str) -> None:
    case = inputs[arch]
    ours = encode_partial(references[arch], (case["pixel_values"], case["grid_thw"]), case["subset"]).flat()
    assert 0 < len(case["subset"]) < int(case["grid_thw"].prod()) // 4  # fewer than every token
    assert sglang[arch]["subset"].shape == ours.shape
    assert relative(sglang[arch]["subset"], ours) < 1e-5
    full = sglang[arch]["full"][case["subset"]]
    assert relative(sglang[arch]["subset"], full) > 1e-3  # the subset's context really is smaller


# --- the child: SGLang's towers in this process ---


def _sglang_outputs(inputs: dict) -> dict:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from engine_ext.vision import encode_partial_sglang

    outputs = {}
    for arch, case in inputs.items():
        # The settings the launcher gives CPU workers; the last publish wins, so each model gets its own.
        server_args = ServerArgs(model_path=case["path"], device="cpu", dtype="float32",
                                 attention_backend="torch_native")
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        if not torch.distributed.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel()
            initialize_dp_attention(server_args)
        model = get_model(model_config=ModelConfig.from_server_args(server_args), load_config=LoadConfig(),
                          device_config=DeviceConfig("cpu", 0))
        visual = model.visual
        pixel_values, grid_thw = case["pixel_values"], case["grid_thw"]
        count = int(grid_thw.prod()) // visual.spatial_merge_size ** 2

        def flat(tokens, visual=visual, pixel_values=pixel_values, grid_thw=grid_thw) -> torch.Tensor:
            embeds, deepstack = encode_partial_sglang(visual, pixel_values, grid_thw, tokens)
            return torch.cat([embeds, *deepstack], dim=-1)

        with torch.no_grad():
            outputs[arch] = {"full": visual(pixel_values, grid_thw), "all": flat(torch.arange(count)),
                             "subset": flat(case["subset"]), "dtype": visual.dtype,
                             "backend": type(visual.blocks[0].attn.qkv_backend).__name__}
    return outputs


if __name__ == "__main__":
    torch.save(_sglang_outputs(torch.load(sys.argv[1])), sys.argv[2])
