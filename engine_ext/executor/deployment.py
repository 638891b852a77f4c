"""The SGLang settings a worker may run the engine extension under, checked as the model is built (worker start).

Every SGLang setting that changes how the forward runs on a GPU is supported, adapted or refused; the README's "GPU
workers" section lists them, with where in SGLang 0.5.23 each was read. The refused ones stop the worker at start,
here, with a message that names the flag and says why: each would make a reuse plan compute something other than
what the extension's path computes, silently (unscaled fp8 K/V, a LoRA segment per row the extension does not pass
on) or not at all (a collective whose ranks disagree). Tensor parallelism is supported (executor.context).

Pure over the server arguments (SGLang's ``ServerArgs``, duck-typed) and the environment, so it is tested without
a worker; the worker calls :func:`check` with ``sglang.srt.runtime_context.get_server_args()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# KV-cache dtypes whose pool holds the model's own dtype: what the extension reads, writes and stores.
KV_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")


class UnsupportedDeployment(RuntimeError):
    """A setting the engine extension refuses; the message names each one."""


def refusals(args: Any, env: Mapping[str, str] | None = None) -> list[str]:
    """Each refused setting in ``args`` (SGLang's server arguments) and ``env``, as 'flag: why'."""
    env = os.environ if env is None else env

    def value(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    found = []
    if (value("pp_size", 1) or 1) > 1:
        found.append("--pp-size: the extension's decoder runs every layer, a pipeline rank holds only some")
    if (value("attn_dp_size", 1) or 1) > 1 or value("enable_dp_attention"):
        found.append("--attn-dp-size (--enable-dp-attention): data-parallel attention ranks must agree on every "
                     "forward's shape and on graph replay, and a reuse plan changes both on one rank")
    if value("speculative_algorithm"):
        found.append("--speculative-algorithm: verify batches replay graphs or need tree masks, and would not "
                     "keep an approximate plan's dropped tokens hidden")
    if value("enable_lora") or value("lora_paths"):
        found.append("--enable-lora (--lora-paths): adapters are applied per request segment of the whole batch, "
                     "and the extension computes a subset of its rows")
    if value("enable_two_batch_overlap") or value("enable_single_batch_overlap"):
        found.append("--enable-two-batch-overlap / --enable-single-batch-overlap: micro-batches the extension's "
                     "decoder does not split")
    dtype = str(value("kv_cache_dtype", "auto") or "auto").lower()
    if dtype not in KV_DTYPES:
        found.append(f"--kv-cache-dtype {dtype}: a quantized KV pool holds scaled K/V the extension would read, "
                     "write and store unscaled")
    prefill_graph = value("cuda_graph_backend_prefill")
    if prefill_graph not in (None, "disabled"):
        found.append(f"--cuda-graph-backend-prefill {prefill_graph}: an extend replayed from a graph runs on a "
                     "padded batch the extension's decoder does not run (SGLang turns it off for Qwen-VL models "
                     "unless asked)")
    if value("enable_unified_memory") or value("enable_page_major_kv_layout"):
        found.append("--enable-unified-memory / --enable-page-major-kv-layout: the pool's slots become virtual "
                     "ids the extension cannot index")
    if value("enable_multimodal") is False:
        found.append("--enable-multimodal false: no image reaches the model, so nothing can be reused")
    if env.get("SGLANG_USE_HND_KVCACHE", "").strip().lower() in ("1", "true", "yes", "on"):
        found.append("SGLANG_USE_HND_KVCACHE: a head-major KV pool the extension cannot index by token slot")
    if env.get("SGLANG_AITER_KV_CACHE_LAYOUT", "").strip().lower() == "vectorized_5d":
        found.append("SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d: a KV pool the extension cannot index by slot")
    return found


def check(args: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise UnsupportedDeployment naming every refused setting, if any."""
    found = refusals(args, env)
    if found:
        raise UnsupportedDeployment("revisit: this worker's SGLang settings are not supported by the engine "
                                    "extension (see the README, GPU workers):\n  " + "\n  ".join(found))


def check_worker() -> None:
    """check() over the worker's own server arguments (inside an SGLang worker process)."""
    from sglang.srt.runtime_context import get_server_args

    check(get_server_args())
