import sys

from coordinator.main import main

sys.exit(main())
