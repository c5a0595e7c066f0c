"""`vllm-triforce bench serve --quick`: two real servers driven by `vllm bench serve`.

SmolLM2-135M (fp32, eager), 4 requests of ~256 tokens, 16 new tokens, concurrency 2: the
table is written, every request completed on both servers, vLLM's own acceptance counters
are in, and TriForce's greedy texts equal the plain server's request by request. Takes
about 3 minutes on a loaded 2-core machine (two server start-ups).
"""

import json

import pytest

from vllm_triforce.tools import cli
from vllm_triforce.tools.bench import serve


def test_client_command_asks_for_what_the_table_needs(tmp_path):
    args = cli_args(tmp_path)
    cmd = serve.client_command("http://127.0.0.1:1", "/m", tmp_path / "p.jsonl", args,
                               tmp_path / "r.json")
    for flag in ("--save-detailed", "--ignore-eos", "--disable-shuffle", "--skip-chat-template"):
        assert flag in cmd
    assert cmd[cmd.index("--temperature") + 1] == "0"
    assert cmd[cmd.index("--dataset-name") + 1] == "custom"
    assert cmd[cmd.index("--max-concurrency") + 1] == "4"
    server = serve.server_command("/m", args, None, tmp_path / "s.json")
    assert server[server.index("--host") + 1] == "127.0.0.1"
    assert server[server.index("--max-num-seqs") + 1] == "4"


def cli_args(tmp_path):
    """The parsed defaults of `vllm-triforce bench serve --out DIR --dtype float32`."""
    return cli.build_parser().parse_args(["bench", "serve", "--out", str(tmp_path),
                                          "--dtype", "float32"])


@pytest.mark.engine
def test_bench_serve_quick(smollm2, tmp_path):
    out = tmp_path / "serve"
    assert cli.main(["bench", "serve", "--quick", "--out", str(out), "--model", str(smollm2),
                     "--dtype", "float32"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["server"] for r in data["rows"]] == ["plain", "triforce2"]
    assert data["config"]["prompt_kinds"] == ["moby-dick"] * 2 + ["sotu-needle"] * 2
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 4
    plain, tri = data["raw"]["plain"], data["raw"]["triforce2"]
    for raw in (plain, tri):
        assert raw["completed"] == 4 and raw["output_lens"] == [16] * 4
    assert tri["generated_texts"] == plain["generated_texts"]
    assert data["all_identical"] is True and data["rows"][1]["identical_requests"] == 4
    assert tri["spec_decode_draft_tokens"] > 0 and "spec_decode_draft_tokens" not in plain
    assert 0 < data["rows"][1]["acceptance"] <= 1
    for row in data["rows"]:
        for metric in serve.METRICS:
            assert row[metric]["p99"] >= row[metric]["median"] > 0
    md = (out / "results.md").read_text()
    assert "| plain |" in md and "| triforce2 |" in md and "yes (4/4)" in md
    assert (out / "logs" / "triforce2.server.log").exists()
