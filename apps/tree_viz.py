"""Draw each speculative step's draft tree live: ``python apps/tree_viz.py [CONFIG] [--host H] [--port P]``.

The same app as ``specflow app``; CONFIG is an experiment YAML (its target and pipelines).
"""

import sys

from specflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["app", *sys.argv[1:]]))
