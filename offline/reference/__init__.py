"""A reference implementation of every reuse path, in plain PyTorch over transformers' Qwen-VL models.

The ground truth the SGLang path is checked against: full prefill with the encoder output and per-token KV captured,
reuse with an identical prefix, position-independent reuse (keys re-positioned, the first r_l of an image's tokens
recomputed at layer l), and the approximate plan (warmup layers, then recompute / reuse / drop sets).

    model = ReferenceModel.load(path)
    prompt = model.prompt(["Look:", image, "What is it?"])
    encoders = model.encode(prompt)
    full = prefill(model, prompt, [Fresh(encoders[0])])
    entry = capture(full.state, prompt.images[0], encoders[0])
    moved = model.prompt(["Another preamble. Look:", image, "What is it?"])
    reuse = prefill(model, moved, [Reuse(entry, uniform(0.1, model.num_layers))])
"""

from offline.reference.compare import Divergence, divergence, greedy, kl_divergence, prefill, teacher_forced
from offline.reference.driver import COMPUTE, DROP, REUSE, KVState, RowPlan, RunResult, decode, reposition, run
from offline.reference.model import EncoderOutput, ImageSpan, Prompt, ReferenceModel
from offline.reference.plans import Approximate, Fresh, ImageKV, Reuse, build, capture, recompute_count, uniform

__all__ = [
    "COMPUTE", "DROP", "REUSE", "Approximate", "Divergence", "EncoderOutput", "Fresh", "ImageKV", "ImageSpan",
    "KVState", "Prompt", "ReferenceModel", "Reuse", "RowPlan", "RunResult", "build", "capture", "decode",
    "divergence", "greedy", "kl_divergence", "prefill", "recompute_count", "reposition", "run", "teacher_forced",
    "uniform",
]
