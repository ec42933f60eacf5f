"""Inference engine: hybrid global + sliding-window model, paged KV cache, prefill and decode workers."""
