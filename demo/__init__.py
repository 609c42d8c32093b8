"""Demo data and tiny offline models: `python -m demo.data`, `python -m demo.shapes`, `python -m demo.tiny models`."""
