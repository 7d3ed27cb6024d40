import argparse

from prl.inference.server import main

parser = argparse.ArgumentParser(prog="python -m prl.inference", description="prl embedded inference server")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
main(parser.parse_args().config)
