import sys

from tf_distrib.launch.cli import main

sys.exit(main())
