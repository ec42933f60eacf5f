"""Operator tools: kvctl (inspect and manage the store) and kvbench (benchmarks, trace replay)."""
