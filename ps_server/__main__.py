import sys

from pstrain.ps_server.main import main

sys.exit(main())
