import sys

from flashckpt.cli import main

sys.exit(main())
