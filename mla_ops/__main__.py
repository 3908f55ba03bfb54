"""`python -m mla_ops` == the `mla-ops` console script."""
import sys

from .cli import main

sys.exit(main())
