import argparse
import os

from prl.system import die_with_parent

parser = argparse.ArgumentParser(prog="python -m prl.trainer", description="prl trainer (one rank, or under torchrun)")
parser.add_argument("--config", required=True, help="the resolved process config (JSON) written by `prl run`")
parser.add_argument("--alone", action="store_true", help="the only rank, not under torchrun (a group of one)")
args = parser.parse_args()
if not args.alone:
    # torchrun starts its workers in sessions of their own, out of reach of the signal that stops
    # torchrun's process group: a worker dies with torchrun instead (also when it is stopped, SIGSTOP).
    # Alone (one rank on one host) this process is the one the driver starts and stops.
    die_with_parent()
    if os.getppid() == 1:
        raise SystemExit("prl.trainer: torchrun exited before this worker started")

from prl.trainer.trainer import main  # noqa: E402

main(args.config, alone=args.alone)
