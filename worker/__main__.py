import sys

from pstrain.worker.main import main

sys.exit(main())
