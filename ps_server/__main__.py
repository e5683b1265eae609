import sys

from ps_server.main import main

sys.exit(main())
