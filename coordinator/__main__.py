import sys

from pstrain.coordinator.main import main

sys.exit(main())
