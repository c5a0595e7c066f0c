"""Load and faults against `vllm serve` with TriForce, loopback only, bounded in time.

32 concurrent streaming completions of mixed lengths, a third of them dropped mid-stream
(the client closes the connection, vLLM aborts the request). The server must stay up,
per-request TriForce state must be freed, and every completed greedy output must equal a
server without speculation.
"""

import concurrent.futures
import json
import time
import urllib.request

import pytest

import tiny_models
from test_serving_plumbing import (TRIFORCE_SPEC, http, metric_total, start_server,  # noqa: F401
                                   vllm_command)

pytestmark = pytest.mark.engine

NUM_REQUESTS = 32
REQUEST_TIMEOUT_S = 240
MAX_TOKENS = 24


def _requests():
    """(prompt, abort?) pairs: prompts from ~10 to ~150 tokens; every third one aborted."""
    return [(tiny_models.make_text(5 + 7 * (i % 12), seed=100 + i), i % 3 == 2)
            for i in range(NUM_REQUESTS)]


def _stream(base: str, prompt: str, abort: bool) -> str | None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if abort and len(text) == 2:
                return None  # leaving the with-block closes the connection mid-stream
    return "".join(text)


def _plain_texts(base: str, prompts: list[str]) -> list[str]:
    texts = []
    for prompt in prompts:
        status, body = http(f"{base}/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, body
        texts.append(json.loads(body)["choices"][0]["text"])
    return texts


def test_concurrent_streams_with_aborts(vllm_command, tiny_llama, tmp_path):
    requests = _requests()
    with start_server(vllm_command, tiny_llama, tmp_path, "plain", None) as base:
        expected = _plain_texts(base, [p for p, _ in requests])
    with start_server(vllm_command, tiny_llama, tmp_path, "triforce", TRIFORCE_SPEC,
                      max_num_seqs=16) as base:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = [pool.submit(_stream, base, p, abort) for p, abort in requests]
            results = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
        print(f"{NUM_REQUESTS} streams in {time.monotonic() - start:.1f} s")
        assert http(f"{base}/health")[0] == 200
        completed = [(r, e) for r, e, (_, abort) in zip(results, expected, requests) if not abort]
        assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // 3
        assert [r for r, _ in completed] == [e for _, e in completed]
        assert metric_total(base, "vllm:triforce_top_proposed_total") > 0
        # state is dropped at the step after a request leaves: one more request flushes it
        assert _plain_texts(base, [requests[0][0]]) == expected[:1]
        assert metric_total(base, "vllm:triforce_live_requests") <= 1
