"""The harnesses that tests, benchmarks and device runs use, kept out of the installed ``kvtier`` package: network
namespaces as hosts (``netns``, ``netns_driver``) and the GPU runs (``gpu_bundle``, ``gpu_ttft``, ``gpu_adapter_check``,
each run as ``python dev/NAME.py`` from the repository root)."""
