"""Tokens per second of ``multi_turn_server.py`` runs, counted from their answers' text with the
GGUF's own tokenizer: sampled answers end at different lengths on different servers, so the
session's seconds alone do not compare them.

    python benchmarks/multi_turn_tokens.py --gguf ~/.cache/specdecode/demo/qwen2.5-coder-1.5b-instruct.gguf \
        benchmarks/results/prefix-cache/sampled-after-sd-1.json benchmarks/results/prefix-cache/sampled-after-ls-1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from llama_cpp import Llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="the served model's GGUF (its tokenizer counts the tokens)")
    parser.add_argument("runs", nargs="+", help="multi_turn_server.py --out files")
    args = parser.parse_args()
    vocab = Llama(model_path=str(Path(args.gguf).expanduser()), vocab_only=True, verbose=False)
    for run in args.runs:
        chats = json.loads(Path(run).read_text())["chats"]["chats"]
        tokens, seconds, per_token, second_ttft = 0, 0.0, [], []
        for chat in chats:
            for turn_index, turn in enumerate(chat["turns"]):
                count = len(vocab.tokenize(turn["text"].encode(), add_bos=False, special=False))
                tokens += count
                seconds += turn["seconds"]
                per_token.append((turn["seconds"] - turn["ttft"]) / max(1, count - 1))
                if turn_index > 0:
                    second_ttft.append(turn["ttft"])
        session = statistics.mean(chat["session_seconds"] for chat in chats)
        print(f"{run}: {tokens} tokens, {tokens / seconds:.2f} tok/s, session mean {session:.2f} s, "
              f"{statistics.median(per_token) * 1e3:.1f} ms a token (median turn), "
              f"later turns' TTFT mean {statistics.mean(second_ttft):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
