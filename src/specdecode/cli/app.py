"""The ``specdecode`` command line: the parser of every command, and ``main``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdecode.cli.args import EXIT_INTERRUPTED, EXIT_USER_ERROR, cli_message
from specdecode.cli.audit import add_audit_parser, cmd_audit
from specdecode.cli.bench import add_bench_parser, add_quality_parser, cmd_bench, cmd_quality
from specdecode.cli.env import add_env_parser, cmd_env
from specdecode.cli.generate import add_generate_parser, cmd_generate
from specdecode.cli.serve import add_serve_parser, cmd_serve
from specdecode.cli.train import add_train_parser, cmd_train
from specdecode.cli.tune import add_distill_parser, add_tune_layerskip_parser, cmd_distill, cmd_tune_layerskip
from specdecode.errors import SpecDecodeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode",
        description="Lossless speculative decoding for Llama-family models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_quality_parser(sub)
    add_tune_layerskip_parser(sub)
    add_distill_parser(sub)
    add_train_parser(sub)
    add_serve_parser(sub)
    add_audit_parser(sub)
    add_env_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "quality":
            return cmd_quality(args)
        if args.command == "tune-layerskip":
            return cmd_tune_layerskip(args)
        if args.command == "distill":
            return cmd_distill(args)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "audit":
            return cmd_audit(args)
        if args.command == "env":
            return cmd_env(args)
    except SpecDecodeError as err:
        print(f"specdecode: error: {cli_message(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`specdecode generate ... | head`): not an error.
        sys.stderr.close()
        return 0
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
