"""`python -m picofx` is the `picofx` command (under torchrun: `torchrun ... -m picofx train ...`)."""
import sys

from picofx.cli import main

sys.exit(main())
