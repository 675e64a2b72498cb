"""Small shared helpers: atomic output files, argparse types, argument checks, stderr lines."""
