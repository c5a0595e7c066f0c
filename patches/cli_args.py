"""`--speculative-config` accepts a path to a JSON file as well as inline JSON.

Why a patch: vLLM 0.32 parses the flag with `optional_type(json.loads)`
(`EngineArgs.add_cli_args`, `engine/arg_utils.py`), so
`vllm serve M --speculative-config triforce.json` dies with "Value
triforce.json cannot be converted ...". The native alternatives
(`"$(cat triforce.json)"`, dotted `--speculative-config.key value`, or a
`--config serve.yaml`) all differ from what users type for every other tool,
and no plugin hook touches argument types. We wrap `EngineArgs.add_cli_args`
and swap the type of that one action after vLLM built it, so every parser made
from `EngineArgs`/`AsyncEngineArgs` (`vllm serve`, `vllm bench`, `run-batch`,
user scripts) accepts both forms once the general plugins are loaded. vLLM's
`AsyncEngineArgs.add_cli_args` loads them itself before building the parser;
scripts that call `EngineArgs.add_cli_args` directly should call
`vllm.plugins.load_general_plugins()` first.

Errors are raised as `argparse.ArgumentTypeError`, so argparse reports them as
"argument --speculative-config/-sc: ..." and exits with status 2 before any
engine or weights exist.
"""

import argparse
import json
import os
from typing import Any

from vllm_triforce.patches import _util

NAME = "cli_args"
FLAG = "--speculative-config"


def _parse_inline(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid inline JSON ({e}) and not an existing file: {value!r}") from e
    return _require_object(parsed, "inline JSON")


def _parse_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from e
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path} is not valid JSON: {e}") from e
    return _require_object(parsed, path)


def _require_object(parsed: Any, source: str) -> dict[str, Any]:
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"{source} must hold a JSON object like {{\"method\": ...}}, "
            f"got {type(parsed).__name__}")
    return parsed


def _looks_like_path(value: str) -> bool:
    return value.endswith(".json") or os.sep in value or value.startswith(("~", "."))


def parse_speculative_config(value: str) -> dict[str, Any] | None:
    """Type for `--speculative-config`: inline JSON object, or a path to a JSON file.

    "" and "None" mean no speculation, as in vLLM.
    """
    if value in ("", "None"):
        return None
    if value.lstrip().startswith("{"):
        return _parse_inline(value)
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        return _parse_file(path)
    if _looks_like_path(value):
        raise argparse.ArgumentTypeError(f"file not found: {value}")
    return _parse_inline(value)



def _find_action(parser: argparse.ArgumentParser) -> argparse.Action:
    action = parser._option_string_actions.get(FLAG)
    if action is None:
        raise RuntimeError(
            f"vllm-triforce: EngineArgs.add_cli_args no longer defines {FLAG}; "
            "this vLLM build is not one the patches were written for.")
    return action


def _make_add_cli_args(original):
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        _find_action(parser).type = parse_speculative_config
        return parser

    return add_cli_args


def apply() -> None:
    _util.check_version()
    _util.wrap("vllm.engine.arg_utils", "EngineArgs.add_cli_args", _make_add_cli_args, NAME)
