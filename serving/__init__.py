"""Serving: the OpenAI-compatible front door over the engine's workers, and the balancers that route to them.

| module | job |
|---|---|
| ``protocol`` | the OpenAI wire shapes: request models, responses, stream chunks, the one error shape |
| ``text`` | the checkpoint's tokenizer, chat template, EOS ids; the incremental detokenizer with stop strings |
| ``cost`` | the fitted step cost model ``t(q, c)`` and the largest chunk that fits a step's budget |
| ``prefill_balance`` | context-length buckets, engines to buckets by demand, least predicted work within one |
| ``decode_balance`` | request count and KV length balanced together |
| ``workers`` | handles to workers: the embedded engine's thread, supervised worker processes |
| ``server`` | validation, admission (429), routing, tokens → text and SSE |
| ``app`` | the ASGI routes (starlette), thin |
| ``metrics`` | the Prometheus metrics of ``GET /metrics`` |
| ``cli`` | ``kvtier-engine serve`` (and the engine's own subcommands) |

``docs/serving.md`` has the endpoints, the P/D topology, the balancers with worked examples and the measurements.
"""
