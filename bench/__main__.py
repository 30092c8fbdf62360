"""bench: load a deployment over real HTTP and report where the time goes.

  python -m bench run --url http://localhost:8000 --closed 1,8,32 --open-qps 18
  python -m bench compare --device sim               # starts the pipeline and the serial baseline here
  python -m bench ceiling --device sim --qps 24,26,28,30 --sla-ms 800
  python -m bench diagnose --url http://localhost:8000
  python -m bench tune --device sim --qps 18 --sla-ms 800
  python -m bench chaos --device sim --qps 8 --duration 60  # kills workers and Redis under load
  python -m bench chaos --scenario failover --qps 20 --duration 40   # the Redis primary SIGKILLed (Sentinel)
  python -m bench chaos --hosts --scenario all --runs 3   # several hosts: partitions, a dead host, clocks (root)
  python -m bench hostile --attack slow-callbacks --duration 60   # one tenant's tarpit, another's callbacks
  python -m bench bound --qps 18,28                         # the floor the device profile allows
  python -m bench feed --device sim --profile fast,story    # the GPU worker alone vs the device's limit
  python -m bench plane --images 1500 --shards 1 --base HEAD~1  # the control plane's Redis per image, per step
  python -m bench run --stack local --profile fast --closed 32 --open-qps ''   # make run's stack vs the decode floor
  python -m bench ab --base HEAD~1 --profile fast --closed 32 --rounds 3     # two builds, runs alternating
  python -m bench instructions --role api,cpu-task --base HEAD~1  # instructions per request / task, two builds
  python -m bench hostile --attack images --base HEAD~1   # hostile image files; what a normal tenant saw
  python -m bench soak --minutes 30 --qps 15 [--burst-qps 40]   # make run's stack for long: does anything grow?

Reports go to the terminal (Markdown) and to --out (JSON, Markdown, PNG charts). Each command's options and the
function that runs it are in its group's module: bench/commands/ (load, faults, parts).
"""

from __future__ import annotations

import argparse
import sys

from bench.commands import faults, load, parts
from bench.commands.common import common_parser, local_parser

GROUPS = (load, faults, parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common, local = common_parser(), local_parser()
    commands = {}
    for group in GROUPS:
        commands.update(group.add_commands(sub, common, local))
    args = parser.parse_args(argv)
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
