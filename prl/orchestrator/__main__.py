import argparse

from prl.orchestrator.orchestrator import main

parser = argparse.ArgumentParser(prog="python -m prl.orchestrator", description="prl orchestrator")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
main(parser.parse_args().config)
