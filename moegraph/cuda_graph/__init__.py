"""Static KV cache, bucketed CUDA-graph capture/replay, and the decode loop behind generate()."""

from .decoder import DecodeStats, GraphDecoder
from .graphs import batch_buckets, bucket_for

__all__ = ["DecodeStats", "GraphDecoder", "batch_buckets", "bucket_for"]
