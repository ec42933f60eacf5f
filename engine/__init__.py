"""Inference engine: hybrid global + sliding-window model, paged KV cache, prefill and decode workers.

    from kvtier.engine.engine import Engine
    engine = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, store="cluster.toml")
    engine.logits(tokens)                      # [len, vocab]: one full forward, no cache, no store
    [r] = engine.generate([tokens], 32)        # greedy: r.tokens, r.hit_tokens, r.replayed, r.ttft_s

``docs/engine.md`` has the block and StateBlock layouts and the hit rule.
"""
