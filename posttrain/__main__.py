"""``python -m posttrain``: the command line."""

from posttrain.cli import main

main()
