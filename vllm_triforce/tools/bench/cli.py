"""`vllm-triforce bench {speed,acceptance,sweep,serve,gpu,selection,report}`: parsers, handlers.

Each benchmark writes results.json, results.md and PNG plots into --out and prints
the directory last on stdout. Child-process logs: <out>/logs/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_triforce.tools.errors import CommandError

DEFAULT_MODEL = "smollm2-135m"


def add_bench_parser(subparsers) -> None:
    from vllm_triforce.tools.bench import (acceptance, gpu_check, results_page, selection_bench,
                                            serve, speed, sweep)

    parser = subparsers.add_parser("bench",
                                   help="benchmarks: speed, acceptance, serve, selection")
    kinds = parser.add_subparsers(dest="kind", required=True,
                                  metavar="{speed,acceptance,sweep,serve,gpu,selection,report}")
    for name, module, text in (("speed", speed, "every vLLM method vs TriForce"),
                               ("acceptance", acceptance, "the paper's Table 1 on our data"),
                               ("sweep", sweep, "TriForce vs plain while one knob varies"),
                               ("serve", serve, "plain vs TriForce server under vLLM's "
                                                "`vllm bench serve`")):
        p = kinds.add_parser(name, help=text)
        _common(p)
        module.add_arguments(p)
        p.set_defaults(func=_handler(name))
    gpu = kinds.add_parser("gpu", help="TriForce inside vLLM on a GPU: exactness, syncs, "
                                       "memory, costs (a dry run without CUDA)")
    gpu_check.add_arguments(gpu)
    gpu.set_defaults(func=gpu_check.handle)
    sel = kinds.add_parser("selection", help="block-selection micro-benchmark")
    selection_bench.add_arguments(sel)
    sel.set_defaults(func=_selection)
    rep = kinds.add_parser("report", help="benchmarks/RESULTS.md from the run folders named in "
                                          "benchmarks/cases.json")
    results_page.add_arguments(rep)
    rep.set_defaults(func=results_page.handle)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--quick", action="store_true", help="tiny inputs (smoke test)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="asset name or model directory")
    p.add_argument("--draft", default=None,
                   help="small draft (asset name or directory): adds draft_model and "
                        "three-level TriForce")
    p.add_argument("--dtype", default=None,
                   help="vLLM dtype for every engine (default: the checkpoint's -- bfloat16 for "
                        "the converted assets -- where the hardware computes bf16 natively, "
                        "else float32: on CPUs without AVX512-BF16/AMX bf16 is emulated and "
                        "several times slower than float32)")


def default_dtype() -> str:
    """"auto" (the checkpoint's dtype) on GPUs and bf16-capable CPUs, else "float32"."""
    import torch

    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "auto"
    return "float32"


def resolve_model(name: str | None) -> str | None:
    if name is None:
        return None
    from vllm_triforce import assets

    if name in assets.MODEL_SPECS:
        return str(assets.ensure_model(name))
    if not Path(name).is_dir():
        raise CommandError(f"{name!r} is neither a known model ({', '.join(assets.MODEL_SPECS)})"
                           " nor a model directory")
    return str(Path(name).resolve())


def _handler(kind: str):
    def handle(args: argparse.Namespace) -> int:
        from vllm_triforce.tools.bench import acceptance, serve, speed, sweep
        from vllm_triforce.tools.bench.runner import BenchError

        args.out.mkdir(parents=True, exist_ok=True)
        if args.dtype is None:
            args.dtype = default_dtype()
        model, draft = resolve_model(args.model), resolve_model(args.draft)
        try:
            if kind == "speed":
                data = speed.run_speed(args, model, draft, args.out)
                ok = data["all_identical"]
            elif kind == "serve":
                ok = serve.run_serve(args, model, draft, args.out)["all_identical"]
            elif kind == "sweep":
                sweep.run_sweep(args, model, args.out)
                ok = True
            else:
                acceptance.run_acceptance(args, model, args.out)
                ok = True
        except BenchError as err:
            raise CommandError(str(err)) from None
        print((args.out / "results.md").read_text())
        print(args.out)
        return 0 if ok else 1
    return handle


def _selection(args: argparse.Namespace) -> int:
    from vllm_triforce.tools.bench import selection_bench

    selection_bench.run(args)
    return 0
