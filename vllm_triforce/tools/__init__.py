"""What the `vllm-triforce` command runs beside the plugin: the CLI, the doctor, the demo,
the vLLM contract check and the benchmark suite (bench/). `vllm serve` imports none of it."""
