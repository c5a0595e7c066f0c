"""benchmarks/RESULTS.md's section of a host-work run (kind "host_rounds"): the run folder
benchmarks/explore/host_per_round.py writes, host ms, the tensor kernels' share of it, aten
operations and Python lines per middle round by batch size, per engine configuration."""

from __future__ import annotations

from vllm_triforce.tools.bench.report import markdown_table


def host_rounds_glance(data: dict) -> str:
    """The at-a-glance cell: per configuration, the largest batch against the smallest."""
    parts = []
    for table in data["tables"]:
        first, last = table["rows"][0], table["rows"][-1]
        part = (f"{table['layers']} layers, refresh {table['refresh_interval']}: batch "
                f"{last['batch']} vs {first['batch']}: host ms/round "
                f"{last['host_ms_per_round'] / first['host_ms_per_round']:.2f}x, Python lines "
                f"{last['python_lines_per_round'] / first['python_lines_per_round']:.2f}x")
        if "round_lines_per_round" in first:  # runs since the lines inside the rounds
            part += (f" (inside the rounds "
                     f"{last['round_lines_per_round'] / first['round_lines_per_round']:.2f}x)")
        if "steady_lines_per_round" in first:  # and the steady steps
            part += (f"; steady steps: host ms/round "
                     f"{last['steady_host_ms_per_round'] / first['steady_host_ms_per_round']:.2f}x"
                     f", Python lines "
                     f"{last['steady_lines_per_round'] / first['steady_lines_per_round']:.2f}x")
        parts.append(part)
    return "; ".join(parts)


def host_rounds_section(data: dict, case) -> tuple[str, str]:
    """(shape line, the table: every configuration's batches, each against its smallest)."""
    config = data["config"]
    shape = (f"Shape: tiny Llama (hidden 64, 2 KV heads, vocabulary 1,024), two levels, "
             f"fixed depth {config['depth']}, greedy, {config['prompt_words']}-word prompts "
             f"past a {config['spec']['retrieval_budget']}-token budget, "
             f"{config['max_tokens']} new tokens, every request drafting (cap "
             f"{data['tables'][0]['cap']}); median of "
             f"{config['repeats']} generations. Steady steps: those whose requests are the "
             f"last step's, every one decoding (no request came, went or prefilled); tensor "
             f"kernels: the time inside aten operations outside the model forwards (a GPU "
             f"runs them on the device); ms columns are per middle round.")
    rows, split = [], all("steady_lines_per_round" in r for t in data["tables"] for r in t["rows"])
    for table in data["tables"]:
        first = table["rows"][0]
        for r in table["rows"]:
            row = [f"{table['layers']} layers, refresh {table['refresh_interval']}", r["batch"],
                   f"{r['host_ms_per_round']:.2f}",
                   f"{r['host_ms_per_round'] / first['host_ms_per_round']:.2f}x"]
            if split:  # the tensor kernels' share, the steady steps, the operations
                row += [f"{r['kernel_ms_per_round']:.2f}", f"{r['host_less_kernels_ms']:.2f}",
                        f"{r['steady_host_ms_per_round']:.2f}",
                        f"{r['steady_host_ms_per_round'] / first['steady_host_ms_per_round']:.2f}x",
                        f"{r['aten_ops_per_round']:.0f}"]
            row += [f"{r['python_lines_per_round']:,.0f}",
                    f"{r['python_lines_per_round'] / first['python_lines_per_round']:.2f}x"]
            if split:  # the rounds' own lines, the steady steps'
                row += [f"{r['round_lines_per_round']:,.0f}",
                        f"{r['steady_lines_per_round']:,.0f}",
                        f"{r['steady_lines_per_round'] / first['steady_lines_per_round']:.2f}x"]
            rows.append(row + [f"{r['forward_ms_per_round']:.2f}"])
    head = ["engine", "batch", "host ms / round", "vs smallest"]
    if split:
        head += ["of which tensor kernels", "less kernels", "steady steps", "vs smallest",
                 "aten ops / round"]
    head += ["Python lines / round", "vs smallest"]
    if split:
        head += ["inside the rounds", "steady steps", "vs smallest"]
    return shape, markdown_table(head + ["model forwards ms / round"], rows)
