"""Started by torchrun from tests/test_adapt.py: several ``clover-lab adapt`` runs in one launch
(one process group for all of them: starting processes is the slow part)."""
import json
import sys

import torch.distributed as dist

from clover_lab.cli.main import main

dist.init_process_group("gloo")
try:
    for argv in json.loads(sys.argv[1]):
        code = main(["adapt", *argv])
        if code:
            sys.exit(code)
finally:
    dist.barrier()  # no rank tears gloo down while the other still uses it
    dist.destroy_process_group()
