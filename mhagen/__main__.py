import sys

from mhagen.cli import main

sys.exit(main())
