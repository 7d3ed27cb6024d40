import argparse

from prl.recipe.roles import load_process_config
from prl.sandbox.worker import main

parser = argparse.ArgumentParser(prog="python -m prl.sandbox", description="prl sandbox worker (a run role)")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
main(load_process_config(parser.parse_args().config))
