"""Chat completions through the OpenAI client: a TriForce server answers exactly as plain does.

SmolLM2-135M is an instruct model and keeps its chat template through our GGUF conversion
(`chat_template.jinja` beside the tokenizer), so this runs by default -- no Qwen download.
The conversation carries a ~600-token Moby-Dick passage, longer than TriForce's retrieval
budget here, so the middle level really drafts from a subset of the context; greedy answers
(non-streamed and streamed) must still equal plain vLLM's (an in-process engine with the
server's settings, through `LLM.chat`), token for token.
"""

import json

import pytest

from test_serving_plumbing import (spec_drafts, start_server,  # noqa: F401 (fixture)
                                   vllm_command)

TRIFORCE_SPEC = {"method": "triforce", "num_speculative_tokens": 4, "retrieval_budget": 256}
PASSAGE_TOKENS = 600
MAX_TOKENS = 48
SERVER_START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def conversation(smollm2) -> list[dict]:
    from vllm_triforce.tools.bench.prompts import book_prompts, tokenizer

    passage = tokenizer(smollm2).decode(book_prompts(smollm2, PASSAGE_TOKENS, 1)[0])
    return [{"role": "system", "content": "You answer questions about books briefly."},
            {"role": "user", "content": f"Here is a passage from Moby-Dick:\n\n{passage}"},
            {"role": "assistant", "content": "I have read it. What would you like to know?"},
            {"role": "user", "content": "Who is speaking in this passage, and where is he?"}]


def test_smollm2_has_a_chat_template(smollm2):
    from vllm_triforce.tools.bench.prompts import tokenizer

    tok = tokenizer(smollm2)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def chat_server(vllm_command, model, tmp_path, name: str, spec: dict | None):
    """`vllm serve model` for chat (SmolLM2, fp32, eager) on a free loopback port."""
    return start_server(vllm_command, model, tmp_path, name, spec, served_name="smol",
                        max_model_len=1024, extra_args=("--seed", "0"),
                        start_timeout_s=SERVER_START_TIMEOUT_S)


def chat_answers(base: str, messages: list[dict]) -> dict:
    """Greedy chat completion, non-streamed and streamed, through the OpenAI client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="EMPTY", timeout=300)
    kwargs = dict(model="smol", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return {"text": plain.choices[0].message.content, "streamed": streamed,
            "finish_reason": plain.choices[0].finish_reason,
            "prompt_tokens": plain.usage.prompt_tokens,
            "completion_tokens": plain.usage.completion_tokens}


def plain_chat_answer(llm, messages: list[dict]) -> dict:
    """Plain vLLM's greedy answer from `llm`, an in-process engine with the servers'
    settings (`start_server`: float32, eager, blocks of 32; the chat server's length and
    seed), through vLLM's own chat template handling (`LLM.chat`): the reference a plain
    server gives, without a second server's start-up (about 40 s here)."""
    from vllm import SamplingParams

    [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                     use_tqdm=False)
    done = out.outputs[0]
    return {"text": done.text, "finish_reason": done.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(done.token_ids)}


@pytest.mark.engine
def test_chat_triforce_equals_plain(vllm_command, smollm2, conversation, tmp_path,
                                    llm_factory):
    with chat_server(vllm_command, smollm2, tmp_path, "triforce", TRIFORCE_SPEC) as base:
        tri = chat_answers(base, conversation)
        assert spec_drafts(base) > 0  # TriForce drafted for the chat requests
    plain = plain_chat_answer(llm_factory(smollm2, max_model_len=1024), conversation)
    print(json.dumps({"plain": plain, "triforce": tri}, indent=1))
    assert plain["prompt_tokens"] > TRIFORCE_SPEC["retrieval_budget"]  # retrieval had to choose
    assert plain["text"]
    assert tri.pop("streamed") == tri["text"]
    assert tri == plain
