import sys

from swallow.cli import main

sys.exit(main())
