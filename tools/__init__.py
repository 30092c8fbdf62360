"""Command-line tools for the people who bring models: `python -m tools.export_pt2`."""
