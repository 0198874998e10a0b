import sys

from qada.cli import main

sys.exit(main())
