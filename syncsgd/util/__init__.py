"""Small shared helpers: atomic output files, argparse value types, argument checks."""
