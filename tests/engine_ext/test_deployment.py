"""The SGLang settings the engine extension refuses (engine_ext.executor.deployment), and the decode batches it keeps
off CUDA graph replay, checked against SGLang 0.5.23's own ServerArgs and graph runner; one refusal end to end, a
real CPU worker that does not start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_ext.executor.deployment import UnsupportedDeployment, check, refusals
from launcher import WorkerSpec, start_worker
from launcher.errors import WorkerExitedError
from tests.conftest import free_port

sglang = pytest.importorskip("sglang.srt.server_args")

# one per refused setting: the server arguments (or environment) that ask for it, and the flag the refusal names
REFUSED = {
    "pp": ({"pp_size": 2}, {}, "--pp-size"),
    "dp attention": ({"attn_dp_size": 2}, {}, "--attn-dp-size"),
    "speculative": ({"speculative_algorithm": "NGRAM"}, {}, "--speculative-algorithm"),
    "lora": ({"enable_lora": True}, {}, "--enable-lora"),
    "lora paths": ({"lora_paths": ["a=/x"]}, {}, "--enable-lora"),
    "two batches": ({"enable_two_batch_overlap": True}, {}, "--enable-two-batch-overlap"),
    "fp8 kv": ({"kv_cache_dtype": "fp8_e4m3"}, {}, "--kv-cache-dtype fp8_e4m3"),
    "prefill graph": ({"cuda_graph_backend_prefill": "breakable"}, {}, "--cuda-graph-backend-prefill breakable"),
    "unified memory": ({"enable_unified_memory": True}, {}, "--enable-unified-memory"),
    "no images": ({"enable_multimodal": False}, {}, "--enable-multimodal false"),
    "hnd layout": ({}, {"SGLANG_USE_HND_KVCACHE": "1"}, "SGLANG_USE_HND_KVCACHE"),
    "aiter layout": ({}, {"SGLANG_AITER_KV_CACHE_LAYOUT": "vectorized_5d"}, "SGLANG_AITER_KV_CACHE_LAYOUT"),
}


def server_args(model_path: Path, **fields):
    return sglang.ServerArgs(model_path=str(model_path), **fields)


def test_sglang_defaults_and_the_supported_settings_pass(tiny_models: dict[str, Path]) -> None:
    path = next(iter(tiny_models.values()))
    check(server_args(path), {})
    supported = server_args(path, chunked_prefill_size=8192, kv_cache_dtype="bfloat16", page_size=16,
                            cuda_graph_backend_prefill="disabled", enable_multimodal=True, disable_radix_cache=True,
                            enable_mixed_chunk=True, enable_torch_compile=True, attention_backend="fa3",
                            tp_size=4)
    assert refusals(supported, {"SGLANG_USE_HND_KVCACHE": "0"}) == []


@pytest.mark.parametrize("case", REFUSED)
def test_each_refused_setting_is_named(tiny_models: dict[str, Path], case: str) -> None:
    fields, env, flag = REFUSED[case]
    args = server_args(next(iter(tiny_models.values())), **fields)
    found = refusals(args, env)
    assert len(found) == 1 and found[0].startswith(flag)
    with pytest.raises(UnsupportedDeployment, match=flag.split()[0]):
        check(args, env)


def test_a_worker_asked_for_a_refused_setting_does_not_start_and_says_why(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    spec = WorkerSpec(model_path=tiny_models["qwen2_5_vl"], port=free_port(), log_file=tmp_path / "worker.log",
                      extra_args=("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"))
    worker = start_worker(spec)
    try:
        with pytest.raises(WorkerExitedError):
            worker.wait_ready(300)
    finally:
        worker.stop()
    log = spec.log_file.read_text()
    assert "not supported by the engine extension" in log and "--enable-lora" in log


def test_a_decode_batch_hiding_dropped_tokens_is_kept_off_graph_replay() -> None:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    from engine_ext.executor.executor import PlanExecutor

    executor = PlanExecutor.__new__(PlanExecutor)  # the hook needs only the hidden tokens and the events
    from engine_ext.executor.approximate import ApproximateHits
    from engine_ext.executor.events import ExecutionEvents

    executor.events = ExecutionEvents()
    executor.approximate = ApproximateHits(None, None)  # type: ignore[arg-type]
    executor.approximate._remember_hidden("hiding", 2, torch.tensor([5, 6]))

    def batch(mode: str, rids: list[str]) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: mode == "decode"), rids=rids,
                               replace_embeds=None)

    plain, hiding, extend = batch("decode", ["a", "b"]), batch("decode", ["a", "hiding"]), batch("extend", ["hiding"])
    for each in (plain, hiding, extend):
        executor.keep_off_graph(each)
    assert plain.replace_embeds is None and extend.replace_embeds is None
    assert hiding.replace_embeds is not None
    assert DecodeCudaGraphRunner.can_run_graph(None, hiding) is False  # SGLang's own check, as installed
    assert executor.events.counts["decode_kept_off_graph"] == 1
