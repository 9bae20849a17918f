import sys

from clover_lab.train.loop import main

sys.exit(main())
