"""CPU-only stand-in for SGLang's ``sgl_kernel`` extension.

SGLang imports ``sgl_kernel`` unconditionally in many modules, but its CPU build is not published
on PyPI. This stand-in is used only where the real package is absent: the worker launcher puts
its parent directory on ``PYTHONPATH`` for CPU workers when ``importlib.util.find_spec("sgl_kernel")``
finds nothing; nowhere else is it importable under this name.

Every attribute of this package resolves lazily to a function that raises ``NotImplementedError``
when called. With ``--attention-backend torch_native`` on CPU none of them is called: SGLang only
needs the names to exist when its modules are imported. Submodules (``sgl_kernel.scalar_type``,
``sgl_kernel.mamba``, ...) deliberately do not exist: SGLang catches the ImportError and falls
back to its own Python implementations.

It also sets placeholders on ``torch.ops.sgl_kernel`` for the ``*_cpu`` ops that SGLang modules
read at import time. Ops that SGLang probes with ``hasattr`` to choose a faster path are left
undefined on purpose, so that the portable PyTorch path is chosen: ``convert_weight_packed``
(its presence turns on the AMX paths), ``fused_qk_norm_cpu`` and ``fused_qk_norm_rope_cpu``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

STAND_IN = True

# Read as torch.ops.sgl_kernel.<name> at module level by SGLang 0.5.23 on CPU.
IMPORT_TIME_OPS = (
    "apply_rotary_pos_emb_cpu",
    "conv3d_embed_cpu",
    "fused_dual_residual_rmsnorm_cpu",
    "fused_gdn_gating_cpu",
    "fused_moe_router_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu",
    "rmsnorm_cpu",
)


def _unavailable(qualname: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname} was called, but sgl_kernel here is the CPU stand-in without kernels; "
            "serve on CPU with --attention-backend torch_native, or install the real sgl_kernel"
        )

    kernel.__name__ = qualname.rpartition(".")[2]
    kernel.__qualname__ = qualname
    return kernel


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # keep the import system's and inspect's probes honest
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _unavailable(f"{__name__}.{name}")
    setattr(sys.modules[__name__], name, value)
    return value


def _register_torch_ops() -> None:
    namespace = torch.ops.sgl_kernel
    for name in IMPORT_TIME_OPS:
        if not hasattr(namespace, name):
            setattr(namespace, name, _unavailable(f"torch.ops.sgl_kernel.{name}"))


_register_torch_ops()
