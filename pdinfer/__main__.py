"""``python -m pdinfer``: the ``pdinfer`` command, for an environment whose scripts folder is not
on PATH."""

import sys

from pdinfer.cli import main

sys.exit(main())
