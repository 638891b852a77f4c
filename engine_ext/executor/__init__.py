"""Plan execution inside SGLang workers.

- :mod:`engine_ext.executor.executor`: ``PlanExecutor``, per forward: which plan each image carries, and the
  layer-by-layer decoder for reused, recomputed and hidden rows (and decode steps that keep dropped rows hidden).
- :mod:`engine_ext.executor.context`: what the parts read (model shape, tensor-parallel ranks and the exchanges
  that keep their decisions the same, store, K/V reader, counts, outcome log), one per worker process.
- :mod:`engine_ext.executor.exact`: an exact hit's reads before the forward.
- :mod:`engine_ext.executor.reused`: stored K/V handed to the layers that use them, waited for per row group.
- :mod:`engine_ext.executor.approximate`: an approximate hit's alias reads, partial vision pass, warmup scores and
  selection at layer W, and the dropped tokens it keeps hidden in decode.
- :mod:`engine_ext.executor.rows`: where each image of a batch sits (prompt rows, batch rows, pool slots), and how
  deep each row is computed (``reuse_depths``).
- :mod:`engine_ext.executor.attention`: attention for the computed rows only, over the KV pool, with keys hidden
  per sequence; the question's attention probabilities on an image (the warmup's score).
- :mod:`engine_ext.executor.entries`: store entries as the worker writes them and reads them (header and encoder
  output before the forward, K/V row groups on a reader thread during it).
- :mod:`engine_ext.executor.events`: what was executed, counted (the worker's /metrics).
- :mod:`engine_ext.executor.model`: the mixin SGLang's model classes take to route forwards through the executor.
- :mod:`engine_ext.executor.deployment`: the SGLang settings the extension refuses, checked at worker start.

``rows``, ``attention`` (but PoolAttention), ``entries`` and ``events`` run without SGLang; the rest runs in a worker.
"""

from engine_ext.executor.entries import StoredImage, read, to_entry
from engine_ext.executor.rows import ImageRows, locate, reuse_depths

__all__ = ["ImageRows", "StoredImage", "locate", "read", "reuse_depths", "to_entry"]
