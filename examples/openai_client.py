"""Talk to a `vllm serve` server with the OpenAI client, then read its speculation metrics.

Start a server first (any model; with TriForce, e.g.):

    vllm serve MODEL --speculative-config triforce.json --port 8000

then:

    python examples/openai_client.py --base-url http://127.0.0.1:8000

Asks about a long passage (the first `--passage-words` words of Moby-Dick, from the text
`scripts/setup.sh` caches; TriForce drafts only for contexts longer than its retrieval
budget) in a completion and a chat completion, each streamed and not streamed, with greedy
decoding, and prints the `vllm:spec_decode_*` and `vllm:triforce_*` counters from
/metrics. `--no-chat` skips chat (models without a chat template).
"""

import argparse
import urllib.request

from openai import OpenAI

QUESTION = "\n\nIn one sentence, what is the narrator's plan in the passage above?"


def long_prompt(words: int) -> str:
    from vllm_triforce.assets import moby_dick_text

    return " ".join(moby_dick_text().split()[:words]) + QUESTION


def completions(client: OpenAI, model: str, prompt: str, max_tokens: int) -> None:
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0)
    print(f"[completion] {plain.choices[0].text!r}")
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    print(f"[completion, streamed] same text: {streamed == plain.choices[0].text}")


def chat(client: OpenAI, model: str, prompt: str, max_tokens: int) -> None:
    messages = [{"role": "user", "content": prompt}]
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
    parser.add_argument("--passage-words", type=int, default=2000,
                        help="words of Moby-Dick before the question (~2,700 tokens)")
    parser.add_argument("--no-chat", action="store_true", help="skip chat completions")
    args = parser.parse_args()

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    print(f"model: {model}")
    prompt = long_prompt(args.passage_words)
    completions(client, model, prompt, args.max_tokens)
    if not args.no_chat:
        chat(client, model, prompt, args.max_tokens)
    print("\n".join(speculation_metrics(args.base_url)) or "no speculation metrics")


if __name__ == "__main__":
    main()
