"""Inference engine: hybrid global + sliding-window model, paged KV cache, prefill and decode workers.

    from kvtier.engine import Engine
    engine = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, store="cluster.toml")
    engine.logits(tokens)                      # [len, vocab]: one full forward, no cache, no store
    [r] = engine.generate([tokens], 32)        # greedy: r.tokens, r.hit_tokens, r.replayed, r.ttft_s

The public API is :class:`Engine`, its :class:`Result` and :class:`PromptError` (a prompt the model cannot
take). Importing this package imports torch; the store (``kvtier.kvstore``) never does.
``docs/engine.md`` has the block and StateBlock layouts and the hit rule.
"""

from kvtier.engine.engine import Engine, PromptError, Result

__all__ = ["Engine", "PromptError", "Result"]
