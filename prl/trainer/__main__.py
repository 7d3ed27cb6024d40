import argparse
import os

from prl.system import die_with_parent

# torchrun starts its workers in sessions of their own, out of reach of the signal that stops
# torchrun's process group: a worker dies with torchrun instead (also when it is stopped, SIGSTOP)
die_with_parent()
if os.getppid() == 1:
    raise SystemExit("prl.trainer: torchrun exited before this worker started")

from prl.trainer.trainer import main  # noqa: E402

parser = argparse.ArgumentParser(prog="python -m prl.trainer", description="prl trainer (run under torchrun)")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
main(parser.parse_args().config)
