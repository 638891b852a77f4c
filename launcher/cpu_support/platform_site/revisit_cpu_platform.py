"""SGLang's CPU platform for tensor-parallel CPU workers: the same, declared out of tree and without PyNccl.

SGLang 0.5.23 builds a PyNccl communicator for every tensor-parallel group unless the platform is out of tree and
says it does not support PyNccl (``srt/distributed/parallel_state.py``, where ``use_pynccl`` is decided; the
in-tree CPU platform is never asked). With a torch built for CUDA, NCCL loads and its communicator then refuses
the CPU device. This platform is SGLang's own CPU platform (``srt/platforms/cpu.py``: gloo for the groups, the
CPU dispatch key), marked out of tree, with ``supports_pynccl`` false (``srt/platforms/interface.py``
``PlatformCapabilities``). SGLang finds it through the ``sglang.srt.platforms`` entry point beside this file and
selects it by ``SGLANG_PLATFORM=revisit_cpu`` (``srt/platforms/__init__.py``); it activates only in a CPU worker
(``SGLANG_USE_CPU_ENGINE=1``). The launcher puts this folder on the ``PYTHONPATH`` of CPU workers started with
``--tp-size`` above 1, and nowhere else.
"""

from __future__ import annotations

import os

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities


class RevisitCpuPlatform(CpuSRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities(graph_capture=False, supports_pynccl=False)

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "cpu"


def activate() -> str | None:
    """The platform's class path in a CPU worker, else None (SGLang's plugin protocol)."""
    return "revisit_cpu_platform.RevisitCpuPlatform" if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" else None
