"""Plan execution inside SGLang workers: locate image rows, read and write store entries, run reuse."""

from engine_ext.executor.entries import StoredImage, read, to_entry
from engine_ext.executor.rows import ImageRows, locate

__all__ = ["ImageRows", "StoredImage", "locate", "read", "to_entry"]
