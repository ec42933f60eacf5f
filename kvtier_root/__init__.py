"""kvtier: a tiered, erasure-coded KV-cache store for LLM inference."""
