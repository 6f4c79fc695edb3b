"""The first example: generate text offline with the engine on a built-in tiny model (no downloads)."""

from engine import LLM, SamplingParams
from engine.tiny_models import builtin_model_dir


def main() -> None:
    # A randomly initialised tiny Llama with a locally trained tokenizer: it babbles, but
    # every part of the engine (paged KV cache, prefix caching, chunked prefill) runs for real.
    llm = LLM(builtin_model_dir("tiny-llama"), max_model_len=256)
    prompts = [
        "The quick brown fox",
        "An inference engine keeps a cache of keys and values",
        "What is the capital of France?",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=24, n=2, logprobs=1)
    for out in llm.generate(prompts, greedy):
        print(f"[greedy]  {out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    for out in llm.generate(prompts[:1], sampled):
        for c in out.outputs:
            print(f"[sample {c.index}] {out.prompt!r} -> {c.text!r} cumulative logprob {c.cumulative_logprob:.2f}")
    chat = llm.chat([{"role": "user", "content": "Hello! How are you today?"}], greedy)[0]
    print(f"[chat]    {chat.outputs[0].text!r}")


if __name__ == "__main__":
    main()
