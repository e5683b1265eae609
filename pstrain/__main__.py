import sys

from pstrain.launcher.cli import main

sys.exit(main())
