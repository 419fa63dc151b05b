"""How results look in the terminal: lines, tables, progress bars, plots."""
