import sys

from sandbox.cli import main

sys.exit(main())
