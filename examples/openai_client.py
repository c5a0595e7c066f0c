"""Talk to a `vllm serve` server with the OpenAI client, then read its speculation metrics.

Start a server first (any model; with TriForce, e.g.):

    vllm serve MODEL --speculative-config triforce.json --port 8000

then:

    python examples/openai_client.py --base-url http://127.0.0.1:8000

Runs a completion and a chat completion, each streamed and not streamed, with greedy
decoding, and prints the `vllm:spec_decode_*` and `vllm:triforce_*` counters from
/metrics. `--no-chat` skips chat (models without a chat template).
"""

import argparse
import urllib.request

from openai import OpenAI

PROMPT = "Write a Python function that checks whether a number is prime."


def completions(client: OpenAI, model: str, max_tokens: int) -> None:
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                      temperature=0)
    print(f"[completion] {plain.choices[0].text!r}")
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    print(f"[completion, streamed] same text: {streamed == plain.choices[0].text}")


def chat(client: OpenAI, model: str, max_tokens: int) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(model=model, messages=messages,
                                           max_tokens=max_tokens, temperature=0)
    text = plain.choices[0].message.content
    print(f"[chat] {text!r}")
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)
    print(f"[chat, streamed] same text: {streamed == text}")


def speculation_metrics(base_url: str) -> list[str]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    wanted = ("vllm:spec_decode_num_", "vllm:triforce_")
    return [ln for ln in lines if ln.startswith(wanted) and "_created" not in ln]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-chat", action="store_true", help="skip chat completions")
    args = parser.parse_args()

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    print(f"model: {model}")
    completions(client, model, args.max_tokens)
    if not args.no_chat:
        chat(client, model, args.max_tokens)
    print("\n".join(speculation_metrics(args.base_url)) or "no speculation metrics")


if __name__ == "__main__":
    main()
