import argparse

from prl.trainer.trainer import main

parser = argparse.ArgumentParser(prog="python -m prl.trainer", description="prl trainer (run under torchrun)")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
main(parser.parse_args().config)
