"""Batched offline generation with TriForce: several long Moby-Dick passages at once.

    .venv/bin/python examples/offline_batch.py [--config examples/triforce_smollm2.json]

Uses SmolLM2-135M (fetched by `vllm-triforce models fetch smollm2-135m` on first use) and
prints each continuation and the per-level TriForce counters from LLM.get_metrics().
"""

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__),
                                                         "triforce_smollm2.json"))
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # metrics in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_triforce.assets import ensure_model, moby_dick_text

    model = str(ensure_model("smollm2-135m"))
    ids = AutoTokenizer.from_pretrained(model)(moby_dick_text()[:400_000])["input_ids"]
    step = (len(ids) - args.prompt_tokens) // args.batch
    prompts = [{"prompt_token_ids": ids[i * step:i * step + args.prompt_tokens]}
               for i in range(args.batch)]
    with open(args.config) as f:
        spec = json.load(f)
    llm = LLM(model, speculative_config=spec, max_model_len=args.prompt_tokens + 256,
              block_size=32, enforce_eager=True, disable_log_stats=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    for out in outs:
        print(repr(out.outputs[0].text[:120]))
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:triforce", "vllm:spec_decode_num")):
            print(metric.name, getattr(metric, "value", ""))


if __name__ == "__main__":
    main()
