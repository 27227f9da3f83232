import sys

from lcx.cli import main

sys.exit(main())
