"""`python -m moeserve ...`: the same command line as the `moeserve` script."""
import sys

from moeserve.cli import main

sys.exit(main())
